// @ts-check
/**
 * The operator's business: plans and their prices, a tenant's own prices, the audit log; and
 * a tenant's account: its plan, prices, limits and quotas, and the keys it mints itself.
 * Prices are shown and typed in dollars per million tokens; the API keeps micro-dollars.
 */
import { html, useState } from '../vendor/preact-htm.js';
import { api } from '../api.js';
import { ErrorNote, ListState, useLoad } from './common.js';
import { Keys } from './keys.js';

/**
 * @typedef {{ name: string, prompt_price: number, cached_prompt_price: number, completion_price: number, batch_percent: number,
 *   batch_prices: { prompt_price: number, cached_prompt_price: number, completion_price: number } }} Plan
 * @typedef {{ prompt_price: number | null, cached_prompt_price: number | null, completion_price: number | null, batch_percent: number | null }} Override
 */

/** The three prices, in the API's names, with their labels. */
const PRICES = [
  ['prompt_price', 'Prompt'],
  ['cached_prompt_price', 'Cached prompt'],
  ['completion_price', 'Completion'],
];

/** Micro-dollars per million tokens, as dollars per million: cents, and finer digits where there are. @param {number} micro */
function perMillion(micro) {
  const fine = (micro / 1e6).toFixed(6).replace(/0+$/, '');
  return `$${fine.split('.')[1].length < 2 ? (micro / 1e6).toFixed(2) : fine}`;
}

/** Dollars per million typed in a field, as micro-dollars; `null` for an empty field. @param {string} typed */
function micro(typed) {
  if (typed.trim() === '') return null;
  const v = Number(typed);
  if (!Number.isFinite(v) || v < 0) throw new Error(`${typed} is not a price (dollars per million tokens)`);
  return Math.round(v * 1e6);
}

/** A plan's prices as fields, dollars per million. @param {Plan | Override} plan */
function fieldsOf(plan) {
  const p = /** @type {Record<string, number | null>} */ (/** @type {unknown} */ (plan));
  /** @type {Record<string, string>} */
  const out = { batch_percent: p.batch_percent == null ? '' : String(p.batch_percent) };
  for (const [k] of PRICES) {
    const v = p[k];
    out[k] = v == null ? '' : String(v / 1e6);
  }
  return out;
}

/**
 * Price fields: the three prices and the batch percent.
 * @param {{ values: Record<string, string>, onChange: (v: Record<string, string>) => void, placeholder?: (k: string) => string }} props
 */
function PriceFields({ values, onChange, placeholder = () => '' }) {
  return html`${PRICES.map(
      ([k, label]) => html`<label>${label} ($ per M tokens) <input inputmode="decimal" value=${values[k]} placeholder=${placeholder(k)}
        onInput=${(/** @type {any} */ e) => onChange({ ...values, [k]: e.currentTarget.value })} /></label>`,
    )}
    <label>Batch (% of the prices) <input type="number" min="0" max="100" step="1" value=${values.batch_percent} placeholder=${placeholder('batch_percent')}
      onInput=${(/** @type {any} */ e) => onChange({ ...values, batch_percent: e.currentTarget.value })} /></label>`;
}

/** The prices of fields, for the API; empty fields left out (`keepEmpty`: sent as null). @param {Record<string, string>} v @param {boolean} keepEmpty */
function pricesOf(v, keepEmpty) {
  /** @type {Record<string, number | null>} */
  const out = {};
  for (const [k] of PRICES) {
    const m = micro(v[k]);
    if (m !== null || keepEmpty) out[k] = m;
  }
  const b = v.batch_percent.trim() === '' ? null : Number(v.batch_percent);
  if (b !== null || keepEmpty) out.batch_percent = b;
  return out;
}

/** @param {{ plan: Plan, onSaved: () => void, onCancel: () => void }} props */
function EditPlan({ plan, onSaved, onCancel }) {
  const [values, setValues] = useState(fieldsOf(plan));
  const [error, setError] = useState(/** @type {unknown} */ (null));
  /** @param {Event} e */
  const save = async (e) => {
    e.preventDefault();
    setError(null);
    try {
      await api('PATCH', `/admin/plans/${encodeURIComponent(plan.name)}`, pricesOf(values, false));
      onSaved();
    } catch (err) {
      setError(err);
    }
  };
  return html`<form class="row" onSubmit=${save} aria-label=${`Prices of ${plan.name}`}>
    <${PriceFields} values=${values} onChange=${setValues} />
    <button type="submit">Save prices</button>
    <button type="button" onClick=${onCancel}>Cancel</button>
    <p class="help">Requests admitted from now on pay the new prices; past bills keep theirs.</p>
    <${ErrorNote} error=${error} />
  </form>`;
}

/** @param {{ onCreated: () => void }} props */
function CreatePlan({ onCreated }) {
  const [name, setName] = useState('');
  const [values, setValues] = useState(/** @type {Record<string, string>} */ ({ prompt_price: '', cached_prompt_price: '', completion_price: '', batch_percent: '50' }));
  const [error, setError] = useState(/** @type {unknown} */ (null));
  /** @param {Event} e */
  const submit = async (e) => {
    e.preventDefault();
    setError(null);
    try {
      await api('POST', '/admin/plans', { name, ...pricesOf(values, false) });
      setName('');
      onCreated();
    } catch (err) {
      setError(err);
    }
  };
  return html`<form class="row" onSubmit=${submit} aria-label="New plan">
    <label>Name <input required value=${name} onInput=${(/** @type {any} */ e) => setName(e.currentTarget.value)} /></label>
    <${PriceFields} values=${values} onChange=${setValues} />
    <button type="submit">Create plan</button>
    <${ErrorNote} error=${error} />
  </form>`;
}

/** A tenant's own prices over its plan's: empty fields are the plan's. */
function TenantPrices() {
  const [tenants] = useLoad(() => api('GET', '/admin/tenants').then((r) => /** @type {{ id: string, name: string }[]} */ (r.data)));
  const [id, setId] = useState('');
  const [prices, setPrices] = useState(/** @type {{ plan: Plan, override: Override, effective: Plan } | null} */ (null));
  const [values, setValues] = useState(/** @type {Record<string, string>} */ ({}));
  const [error, setError] = useState(/** @type {unknown} */ (null));
  /** @param {string} tenant */
  const pick = async (tenant) => {
    setId(tenant);
    setPrices(null);
    setError(null);
    if (!tenant) return;
    try {
      const p = await api('GET', `/admin/tenants/${encodeURIComponent(tenant)}/prices`);
      setPrices(p);
      setValues(fieldsOf(p.override));
    } catch (err) {
      setError(err);
    }
  };
  /** @param {Record<string, number | null>} body */
  const put = async (body) => {
    setError(null);
    try {
      const p = await api('PUT', `/admin/tenants/${encodeURIComponent(id)}/prices`, body);
      setPrices(p);
      setValues(fieldsOf(p.override));
    } catch (err) {
      setError(err);
    }
  };
  return html`<section aria-label="A tenant's own prices">
    <h2>A tenant's own prices</h2>
    <label>Tenant <select value=${id} onChange=${(/** @type {any} */ e) => pick(e.currentTarget.value)}>
      <option value="">Choose a tenant</option>
      ${(tenants ?? []).map((t) => html`<option value=${t.id}>${t.name}</option>`)}
    </select></label>
    ${prices
      ? html`<form class="row" aria-label="Own prices" onSubmit=${(/** @type {Event} */ e) => { e.preventDefault(); try { put(pricesOf(values, true)); } catch (err) { setError(err); } }}>
          <${PriceFields} values=${values} onChange=${setValues}
            placeholder=${(/** @type {string} */ k) => `plan: ${k === 'batch_percent' ? prices.plan.batch_percent + '%' : perMillion(/** @type {any} */ (prices.plan)[k])}`} />
          <button type="submit">Save own prices</button>
          <button type="button" onClick=${() => put({})}>Use the plan's prices</button>
        </form>
        <p role="status">Pays (plan ${prices.plan.name}): ${PRICES.map(([k, l]) => `${l} ${perMillion(/** @type {any} */ (prices.effective)[k])}`).join(', ')}; batch ${prices.effective.batch_percent}%.</p>`
      : null}
    <${ErrorNote} error=${error} />
  </section>`;
}

/** The operator's plans: their prices, edited in place; new plans; a tenant's own prices. */
export function Plans() {
  const [plans, error, reload] = useLoad(() => api('GET', '/admin/plans').then((r) => /** @type {Plan[]} */ (r.data)));
  const [editing, setEditing] = useState(/** @type {string | null} */ (null));
  return html`<section>
    <p class="help">Prices are in dollars per million tokens; a batch token costs the batch percent of them.</p>
    <${CreatePlan} onCreated=${reload} />
    <${ListState} data=${plans} error=${error} empty="No plans." />
    ${plans && plans.length > 0
      ? html`<table aria-label="Plans">
          <thead><tr><th scope="col">Plan</th>${PRICES.map(([, l]) => html`<th scope="col">${l}</th>`)}<th scope="col">Batch</th><th scope="col">Actions</th></tr></thead>
          <tbody>
            ${plans.map(
              (p) => html`<tr key=${p.name}>
                  <th scope="row" class="name">${p.name}</th>
                  ${PRICES.map(([k]) => html`<td>${perMillion(/** @type {any} */ (p)[k])}</td>`)}
                  <td>${p.batch_percent}%</td>
                  <td class="actions"><button type="button" aria-expanded=${editing === p.name} onClick=${() => setEditing(editing === p.name ? null : p.name)}>Edit prices</button></td>
                </tr>
                ${editing === p.name
                  ? html`<tr key=${`${p.name}-edit`}><td colspan="6"><${EditPlan} plan=${p} onSaved=${() => { setEditing(null); reload(); }} onCancel=${() => setEditing(null)} /></td></tr>`
                  : null}`,
            )}
          </tbody>
        </table>`
      : null}
    <${TenantPrices} />
  </section>`;
}

/**
 * @typedef {{ id: string, at: number, actor: string | null, actor_name: string | null, key_id: string, tenant_id: string | null,
 *   tenant: string | null, action: string, target: string, detail: unknown }} Entry
 */

/** The audit log, newest first, a page at a time; filtered to one tenant. */
export function AuditLog() {
  const [tenants] = useLoad(() => api('GET', '/admin/tenants').then((r) => /** @type {{ id: string, name: string }[]} */ (r.data)));
  const [tenant, setTenant] = useState('');
  const [before, setBefore] = useState(/** @type {number[]} */ ([]));
  const query = `/admin/audit?limit=50${tenant ? `&tenant_id=${encodeURIComponent(tenant)}` : ''}${before.length ? `&before=${before[before.length - 1]}` : ''}`;
  const [entries, error] = useLoad(() => api('GET', query).then((r) => /** @type {Entry[]} */ (r.data)), [query]);
  return html`<section>
    <p class="help">Every change made by the operator, and every change a tenant makes to its keys, adapters, files and batches.</p>
    <label>Tenant <select value=${tenant} onChange=${(/** @type {any} */ e) => { setTenant(e.currentTarget.value); setBefore([]); }}>
      <option value="">Everyone</option>
      ${(tenants ?? []).map((t) => html`<option value=${t.id}>${t.name}</option>`)}
    </select></label>
    <${ListState} data=${entries} error=${error} empty="No changes." />
    ${entries && entries.length > 0
      ? html`<table aria-label="Audit log">
          <thead><tr><th scope="col">When</th><th scope="col">Who</th><th scope="col">What</th><th scope="col">Of</th><th scope="col">Tenant</th><th scope="col">Detail</th></tr></thead>
          <tbody>
            ${entries.map(
              (e) => html`<tr key=${e.id}>
                <th scope="row">${new Date(e.at).toISOString().slice(0, 19).replace('T', ' ')}</th>
                <td>${e.actor_name ?? e.actor ?? 'operator'}</td>
                <td><code>${e.action}</code></td>
                <td>${e.target}</td>
                <td>${e.tenant ?? e.tenant_id ?? ''}</td>
                <td><code class="detail">${JSON.stringify(e.detail)}</code></td>
              </tr>`,
            )}
          </tbody>
        </table>`
      : null}
    <div class="row">
      ${before.length > 0 ? html`<button type="button" onClick=${() => setBefore(before.slice(0, -1))}>Newer</button>` : null}
      ${entries && entries.length === 50 ? html`<button type="button" onClick=${() => setBefore([...before, entries[entries.length - 1].at])}>Older</button>` : null}
    </div>
  </section>`;
}

/**
 * @typedef {{ used: number, limit: number | null, left: number | null }} Quota
 * @typedef {{ tenant: { id: string, name: string, plan: string }, prices: Plan, limits: Record<string, number | null>,
 *   key: { id: string, prefix: string, scopes: string[] }, quotas: Record<string, Quota> }} Me
 */

const QUOTAS = [
  ['adapters', 'Adapters'],
  ['adapter_bytes', 'Adapter bytes'],
  ['file_bytes', 'File storage bytes'],
  ['keys', 'Live keys'],
];

/** A tenant's account: its plan, the prices it pays, its limits and quotas, its keys. */
export function Account() {
  const [me, error] = useLoad(() => api('GET', '/v1/me').then((r) => /** @type {Me} */ (r)));
  return html`<section>
    <${ListState} data=${me} error=${error} empty="" />
    ${me
      ? html`<h2>Plan ${me.tenant.plan}</h2>
          <table aria-label="Prices">
            <thead><tr><th scope="col">Tokens</th><th scope="col">Price ($ per M)</th><th scope="col">In a batch</th></tr></thead>
            <tbody>
              ${PRICES.map(
                ([k, l]) => html`<tr key=${k}><th scope="row">${l}</th><td>${perMillion(/** @type {any} */ (me.prices)[k])}</td>
                  <td>${perMillion(/** @type {any} */ (me.prices.batch_prices)[k])}</td></tr>`,
              )}
            </tbody>
          </table>
          <h2>Quotas</h2>
          <table aria-label="Quotas">
            <thead><tr><th scope="col">Quota</th><th scope="col">Used</th><th scope="col">Limit</th><th scope="col">Left</th></tr></thead>
            <tbody>
              ${QUOTAS.map(
                ([k, l]) => html`<tr key=${k}><th scope="row">${l}</th><td>${me.quotas[k].used}</td>
                  <td>${me.quotas[k].limit ?? 'unlimited'}</td><td>${me.quotas[k].left ?? 'unlimited'}</td></tr>`,
              )}
            </tbody>
          </table>
          <h2>Keys</h2>
          <p class="help">A new key has this key's scopes or fewer; its secret is shown once.</p>
          <${Keys} base="/v1/keys" revoke="/v1/keys" owner=${me.tenant.name} scopes=${me.key.scopes} initial=${me.key.scopes} />`
      : null}
  </section>`;
}
