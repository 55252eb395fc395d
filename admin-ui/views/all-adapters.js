// @ts-check
/** The operator's view of every adapter: owner, versions, size, rank, targets; publishing. */
import { html, useState } from '../vendor/preact-htm.js';
import { api } from '../api.js';
import { Confirm, ErrorNote, useLoad } from './common.js';

/**
 * @typedef {{ id: string, name: string, version: number, versions: number, owner: string | null, owner_name: string | null,
 *   public: boolean, rank: number, targets: string[], bytes_all_versions: number }} Row
 */

export function AllAdapters() {
  const [rows, error, reload] = useLoad(() => api('GET', '/admin/adapters').then((r) => /** @type {Row[]} */ (r.data)));
  const [confirming, setConfirming] = useState(/** @type {string | null} */ (null));
  const [actionError, setActionError] = useState(/** @type {{ id: string, error: unknown } | null} */ (null));
  /** @param {Row} a @param {boolean} pub */
  const publish = async (a, pub) => {
    setActionError(null);
    /** @type {Record<string, unknown>} */
    const body = { name: a.name, public: pub };
    if (a.owner) body.tenant_id = a.owner;
    try {
      await api('POST', '/admin/adapters/publish', body);
      setConfirming(null);
      reload();
    } catch (e) {
      setActionError({ id: a.id, error: e });
      throw e;
    }
  };
  return html`<section>
    <${ErrorNote} error=${error} />
    ${rows === undefined && !error ? html`<p class="loading">Loading…</p>` : null}
    ${rows && rows.length === 0 ? html`<p>No adapters yet.</p>` : null}
    ${rows && rows.length > 0
      ? html`<table aria-label="Every adapter">
          <thead><tr><th scope="col">Adapter</th><th scope="col">Owner</th><th scope="col">Latest version</th><th scope="col">Versions</th>
            <th scope="col">Rank</th><th scope="col">Targets</th><th scope="col">Size (all versions)</th><th scope="col">Published</th><th scope="col">Actions</th></tr></thead>
          <tbody>
            ${rows.map(
              (a) => html`<tr key=${a.id}>
                <th scope="row" class="name">${a.name}</th>
                <td>${a.owner_name ?? 'operator'}</td>
                <td>${a.version}</td>
                <td>${a.versions}</td>
                <td>${a.rank}</td>
                <td>${a.targets.join(', ')}</td>
                <td>${(a.bytes_all_versions / 1e6).toFixed(2)} MB</td>
                <td>${a.public ? 'yes' : 'no'}</td>
                <td class="actions">
                  ${a.public
                    ? html`<button type="button" class="danger" onClick=${() => setConfirming(a.id)}>Unpublish</button>`
                    : html`<button type="button" onClick=${() => publish(a, true).catch(() => {})}>Publish</button>`}
                  ${confirming === a.id
                    ? html`<${Confirm} question=${`Unpublish ${a.name}? Other tenants can no longer use it.`} action="Unpublish"
                        onConfirm=${() => publish(a, false)} onCancel=${() => setConfirming(null)} />`
                    : null}
                  ${actionError && actionError.id === a.id && confirming !== a.id ? html`<${ErrorNote} error=${actionError.error} />` : null}
                </td>
              </tr>`,
            )}
          </tbody>
        </table>`
      : null}
  </section>`;
}
