// @ts-check
/** The operator's view of every adapter: owner, versions, size, rank, targets; publishing. */
import { html, useState } from '../vendor/preact-htm.js';
import { api } from '../api.js';
import { ConfirmButton, ErrorNote, ListState, useLoad } from './common.js';

/**
 * @typedef {{ id: string, name: string, version: number, versions: number, owner: string | null, owner_name: string | null,
 *   public: boolean, rank: number, targets: string[], bytes_all_versions: number }} Row
 */

export function AllAdapters() {
  const [rows, error, reload] = useLoad(() => api('GET', '/admin/adapters').then((r) => /** @type {Row[]} */ (r.data)));
  const [actionError, setActionError] = useState(/** @type {{ id: string, error: unknown } | null} */ (null));
  /** @param {Row} a @param {boolean} pub */
  const setPublic = async (a, pub) => {
    /** @type {Record<string, unknown>} */
    const body = { name: a.name, public: pub };
    if (a.owner) body.tenant_id = a.owner;
    await api('POST', '/admin/adapters/publish', body);
    reload();
  };
  /** @param {Row} a */
  const publish = (a) => {
    setActionError(null);
    setPublic(a, true).catch((e) => setActionError({ id: a.id, error: e }));
  };
  return html`<section>
    <${ListState} data=${rows} error=${error} empty="No adapters yet." />
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
                    ? html`<${ConfirmButton} label="Unpublish" question=${`Unpublish ${a.name}? Other tenants can no longer use it.`} action="Unpublish"
                        onConfirm=${() => setPublic(a, false)} />`
                    : html`<button type="button" onClick=${() => publish(a)}>Publish</button>`}
                  ${actionError && actionError.id === a.id ? html`<${ErrorNote} error=${actionError.error} />` : null}
                </td>
              </tr>`,
            )}
          </tbody>
        </table>`
      : null}
  </section>`;
}
