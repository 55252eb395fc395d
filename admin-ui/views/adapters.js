// @ts-check
/** A tenant's own adapters (and the published ones it may use), from `GET /v1/adapters`. */
import { html } from '../vendor/preact-htm.js';
import { api } from '../api.js';
import { ErrorNote, useLoad } from './common.js';

export function MyAdapters() {
  const [adapters, error] = useLoad(() => api('GET', '/v1/adapters').then((r) => /** @type {any[]} */ (r.data)));
  return html`<section>
    <${ErrorNote} error=${error} />
    ${adapters === undefined && !error ? html`<p class="loading">Loading…</p>` : null}
    ${adapters && adapters.length === 0 ? html`<p>No adapters yet.</p>` : null}
    ${adapters && adapters.length > 0
      ? html`<table>
          <caption class="sr-only">Adapters</caption>
          <thead><tr><th scope="col">Name</th><th scope="col">Version</th><th scope="col">Rank</th><th scope="col">Targets</th><th scope="col">Size</th><th scope="col">Published</th></tr></thead>
          <tbody>
            ${adapters.map(
              (a) => html`<tr key=${a.id}>
                <th scope="row" class="name">${a.name}</th>
                <td>${a.version}</td>
                <td>${a.rank}</td>
                <td>${Array.isArray(a.targets) ? a.targets.join(', ') : ''}</td>
                <td>${(a.bytes / 1e6).toFixed(1)} MB</td>
                <td>${a.public ? 'yes' : 'no'}</td>
              </tr>`,
            )}
          </tbody>
        </table>`
      : null}
  </section>`;
}
