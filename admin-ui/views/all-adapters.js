// @ts-check
/**
 * The operator's view of every adapter: owner, versions, size, rank, targets, where the latest
 * version is on each worker (pool, host memory, disk) and who pins it; publishing, pinning and
 * letting pins go.
 */
import { html, useState } from '../vendor/preact-htm.js';
import { api } from '../api.js';
import { BaseModelCell, ConfirmButton, ErrorNote, ListState, useLoad } from './common.js';

/**
 * @typedef {{ worker: number, tier: 'pool' | 'host' | 'loading' | 'disk' | 'failed' | 'unknown', error?: string }} Residency
 * @typedef {{ tenant_id: string | null, tenant: string | null, version: number }} Pin
 * @typedef {{ id: string, name: string, version: number, versions: number, owner: string | null, owner_name: string | null,
 *   public: boolean, rank: number, targets: string[], bytes_all_versions: number, residency: Residency[], pinned_by: Pin[],
 *   base_model: string | null, usable: boolean, unusable_reason: string | null }} Row
 */

/** What each tier means, for the cell's title. */
const TIERS = {
  pool: 'in pool pages: requests use it without a load',
  host: 'in host memory: a copy into the pool away',
  loading: 'being read from disk',
  disk: 'only on disk',
  failed: 'its last load was refused',
  unknown: 'the worker is being rebuilt',
};

/** One line per worker when there are several. @param {{ residency: Residency[] }} props */
function Where({ residency }) {
  const one = residency.length === 1;
  return html`<ul class="pins">
    ${residency.map(
      (r) => html`<li key=${r.worker} title=${TIERS[r.tier]}>${one ? '' : `worker ${r.worker}: `}<strong>${r.tier}</strong>${r.error ? html` (${r.error})` : null}</li>`,
    )}
  </ul>`;
}

/** @param {Pin} p @param {Row} a */
const pinName = (p, a) => `${p.tenant_id === null ? 'operator' : (p.tenant ?? p.tenant_id)}${p.version === a.version ? '' : ` (version ${p.version})`}`;

export function AllAdapters() {
  const [rows, error, reload] = useLoad(() => api('GET', '/admin/adapters').then((r) => /** @type {Row[]} */ (r.data)));
  const [actionError, setActionError] = useState(/** @type {{ id: string, error: unknown } | null} */ (null));
  const [busy, setBusy] = useState(/** @type {string | null} */ (null));
  /** The adapter as the admin routes name it. @param {Row} a */
  const named = (a) => (a.owner ? { tenant_id: a.owner, name: a.name } : { name: a.name });
  /** @param {Row} a @param {boolean} pub */
  const setPublic = (a, pub) => api('POST', '/admin/adapters/publish', { ...named(a), public: pub });
  /** Runs an action whose errors show on its row. @param {Row} a @param {() => Promise<unknown>} action */
  const act = async (a, action) => {
    setActionError(null);
    setBusy(a.id);
    try {
      await action();
    } catch (e) {
      setActionError({ id: a.id, error: e });
    } finally {
      setBusy(null);
      reload();
    }
  };
  /** Pins the latest version as the operator; a 202 (still loading) says so. @param {Row} a */
  const pin = (a) =>
    act(a, async () => {
      const r = await api('POST', '/admin/adapters/pin', named(a));
      if (!r.held) throw new Error(`${a.name} is still on its way into the pool (${r.workers.join(', ')}); pin it again in a moment.`);
    });
  /** Lets one holder's pins go (the operator's: `null`). @param {Row} a @param {string | null} holder */
  const unpin = async (a, holder) => {
    await api('POST', '/admin/adapters/unpin', holder === null ? named(a) : { ...named(a), holder });
    reload();
  };
  return html`<section>
    <p class="help">Residency is the latest version's, on each worker. A pinned adapter stays in the pool until every holder lets it go.</p>
    <${ListState} data=${rows} error=${error} empty="No adapters yet." />
    ${rows && rows.length > 0
      ? html`<table aria-label="Every adapter">
          <thead><tr><th scope="col">Adapter</th><th scope="col">Owner</th><th scope="col">Latest version</th><th scope="col">Versions</th>
            <th scope="col">Rank</th><th scope="col">Targets</th><th scope="col">Size (all versions)</th><th scope="col">Published</th>
            <th scope="col">Base model</th><th scope="col">Residency</th><th scope="col">Pinned by</th><th scope="col">Actions</th></tr></thead>
          <tbody>
            ${rows.map((a) => {
              const mine = a.pinned_by.some((p) => p.tenant_id === null);
              const others = [...new Set(a.pinned_by.filter((p) => p.tenant_id !== null).map((p) => /** @type {string} */ (p.tenant_id)))];
              return html`<tr key=${a.id}>
                <th scope="row" class="name">${a.name}</th>
                <td>${a.owner_name ?? 'operator'}</td>
                <td>${a.version}</td>
                <td>${a.versions}</td>
                <td>${a.rank}</td>
                <td>${a.targets.join(', ')}</td>
                <td>${(a.bytes_all_versions / 1e6).toFixed(2)} MB</td>
                <td>${a.public ? 'yes' : 'no'}</td>
                <${BaseModelCell} adapter=${a} />
                <td><${Where} residency=${a.residency} /></td>
                <td>${a.pinned_by.length === 0 ? 'nobody' : html`<ul class="pins">${a.pinned_by.map((p) => html`<li>${pinName(p, a)}</li>`)}</ul>`}</td>
                <td class="actions">
                  ${a.public
                    ? html`<${ConfirmButton} label="Unpublish" question=${`Unpublish ${a.name}? Other tenants can no longer use it.`} action="Unpublish"
                        onConfirm=${() => setPublic(a, false).then(reload)} />`
                    : html`<button type="button" onClick=${() => act(a, () => setPublic(a, true))}>Publish</button>`}
                  ${mine
                    ? html`<${ConfirmButton} label="Unpin" question=${`Let the operator's pin of ${a.name} go? It may be evicted when the pool needs room.`}
                        action="Unpin" onConfirm=${() => unpin(a, null)} />`
                    : html`<button type="button" disabled=${busy === a.id} onClick=${() => pin(a)}>Pin</button>`}
                  ${others.map((id) => {
                    const who = a.pinned_by.find((p) => p.tenant_id === id)?.tenant ?? id;
                    return html`<${ConfirmButton} label=${`Release ${who}'s pin`} question=${`Let ${who}'s pin of ${a.name} go? The tenant can load it again.`}
                      action="Release" onConfirm=${() => unpin(a, id)} />`;
                  })}
                  ${actionError && actionError.id === a.id ? html`<${ErrorNote} error=${actionError.error} />` : null}
                </td>
              </tr>`;
            })}
          </tbody>
        </table>`
      : null}
  </section>`;
}
