// @ts-check
/** The operator's tenants: create, edit plan, weight and limits, delete, their keys. */
import { html, useState } from '../vendor/preact-htm.js';
import { api } from '../api.js';
import { ConfirmButton, ErrorNote, ListState, useLoad } from './common.js';
import { Keys } from './keys.js';

/** Limits a tenant may have, in the API's names, with their labels. */
const LIMITS = [
  ['requests_per_min', 'Requests per minute'],
  ['tokens_per_min', 'Tokens per minute'],
  ['max_concurrent', 'Concurrent requests'],
  ['max_adapters', 'Adapters'],
  ['max_adapter_bytes', 'Adapter bytes'],
  ['max_pinned_pages', 'Pinned pages'],
];

/** Scopes a tenant's key may carry. */
const TENANT_SCOPES = ['inference', 'adapters'];

/**
 * @typedef {{ id: string, name: string, plan: string, weight: number, created_at: number } & Record<string, any>} Tenant
 */

/** @param {{ onCreated: () => void }} props */
function CreateTenant({ onCreated }) {
  const [name, setName] = useState('');
  const [plan, setPlan] = useState('standard');
  const [weight, setWeight] = useState('1');
  const [error, setError] = useState(/** @type {unknown} */ (null));
  /** @param {Event} e */
  const submit = async (e) => {
    e.preventDefault();
    setError(null);
    try {
      await api('POST', '/admin/tenants', { name, plan, weight: Number(weight) });
      setName('');
      onCreated();
    } catch (err) {
      setError(err);
    }
  };
  return html`<form class="row" onSubmit=${submit} aria-label="New tenant">
    <label>Name <input required value=${name} onInput=${(/** @type {any} */ e) => setName(e.currentTarget.value)} /></label>
    <label>Plan <input required value=${plan} onInput=${(/** @type {any} */ e) => setPlan(e.currentTarget.value)} /></label>
    <label>Weight <input type="number" min="0.01" step="any" required value=${weight}
      onInput=${(/** @type {any} */ e) => setWeight(e.currentTarget.value)} /></label>
    <button type="submit">Create tenant</button>
    <${ErrorNote} error=${error} />
  </form>`;
}

/** @param {{ tenant: Tenant, onSaved: () => void, onCancel: () => void }} props */
function EditTenant({ tenant, onSaved, onCancel }) {
  const [plan, setPlan] = useState(tenant.plan);
  const [weight, setWeight] = useState(String(tenant.weight));
  const [limits, setLimits] = useState(
    /** @type {Record<string, string>} */ (Object.fromEntries(LIMITS.map(([k]) => [k, tenant[k] == null ? '' : String(tenant[k])]))),
  );
  const [error, setError] = useState(/** @type {unknown} */ (null));
  /** @param {Event} e */
  const submit = async (e) => {
    e.preventDefault();
    setError(null);
    // A merge patch: an empty limit is cleared (null: unlimited).
    const patch = {
      plan,
      weight: Number(weight),
      limits: Object.fromEntries(LIMITS.map(([k]) => [k, limits[k].trim() === '' ? null : Number(limits[k])])),
    };
    try {
      await api('PATCH', `/admin/tenants/${encodeURIComponent(tenant.id)}`, patch);
      onSaved();
    } catch (err) {
      setError(err);
    }
  };
  return html`<form class="edit" onSubmit=${submit} aria-label=${`Edit ${tenant.name}`}>
    <label>Plan <input required value=${plan} onInput=${(/** @type {any} */ e) => setPlan(e.currentTarget.value)} /></label>
    <label>Weight <input type="number" min="0.01" step="any" required value=${weight}
      onInput=${(/** @type {any} */ e) => setWeight(e.currentTarget.value)} /></label>
    ${LIMITS.map(
      ([k, label]) => html`<label>${label} <input type="number" min="0" step="1" placeholder="unlimited" value=${limits[k]}
        onInput=${(/** @type {any} */ e) => setLimits({ ...limits, [k]: e.currentTarget.value })} /></label>`,
    )}
    <button type="submit">Save</button>
    <button type="button" onClick=${onCancel}>Cancel</button>
    <${ErrorNote} error=${error} />
  </form>`;
}

/** @param {Tenant} t */
function limitsText(t) {
  const set = LIMITS.filter(([k]) => t[k] != null).map(([k, label]) => `${label}: ${t[k]}`);
  return set.length ? set.join(', ') : 'none';
}

export function Tenants() {
  const [tenants, error, reload] = useLoad(() => api('GET', '/admin/tenants').then((r) => /** @type {Tenant[]} */ (r.data)));
  const [open, setOpen] = useState(/** @type {{ id: string, what: 'edit' | 'keys' } | null} */ (null));
  const close = () => setOpen(null);
  const done = () => {
    setOpen(null);
    reload();
  };
  return html`<section>
    <h2>New tenant</h2>
    <${CreateTenant} onCreated=${reload} />
    <h2>All tenants</h2>
    <${ListState} data=${tenants} error=${error} empty="No tenants yet." />
    ${tenants && tenants.length > 0
      ? html`<table>
          <caption class="sr-only">Tenants</caption>
          <thead><tr><th scope="col">Name</th><th scope="col">Plan</th><th scope="col">Weight</th><th scope="col">Limits</th>
            <th scope="col">Created</th><th scope="col">Actions</th></tr></thead>
          <tbody>
            ${tenants.map(
              (t) => html`<tr key=${t.id}>
                <th scope="row" class="name">${t.name}</th>
                <td>${t.plan}</td>
                <td>${t.weight}</td>
                <td>${limitsText(t)}</td>
                <td>${new Date(t.created_at).toISOString().slice(0, 10)}</td>
                <td class="actions">
                  <button type="button" onClick=${() => setOpen({ id: t.id, what: 'edit' })}>Edit</button>
                  <button type="button" aria-expanded=${open?.id === t.id && open.what === 'keys'}
                    onClick=${() => setOpen(open?.id === t.id && open.what === 'keys' ? null : { id: t.id, what: 'keys' })}>Keys</button>
                  <${ConfirmButton} label="Delete" question=${`Delete tenant ${t.name}? Its keys are revoked and its adapters deleted.`} action="Delete tenant"
                    onConfirm=${async () => { await api('DELETE', `/admin/tenants/${encodeURIComponent(t.id)}`); done(); }} />
                  ${open && open.id === t.id && open.what === 'edit' ? html`<${EditTenant} tenant=${t} onSaved=${done} onCancel=${close} />` : null}
                  ${open && open.id === t.id && open.what === 'keys'
                    ? html`<${Keys} base=${`/admin/tenants/${encodeURIComponent(t.id)}/keys`} owner=${t.name} scopes=${TENANT_SCOPES} initial=${TENANT_SCOPES} />`
                    : null}
                </td>
              </tr>`,
            )}
          </tbody>
        </table>`
      : null}
  </section>`;
}
