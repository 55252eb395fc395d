// @ts-check
/** Keys: a list (never secrets), minting with scopes (the secret shown once), revoking. */
import { html, useState } from '../vendor/preact-htm.js';
import { api } from '../api.js';
import { ConfirmButton, ErrorNote, ListState, Secret, useLoad } from './common.js';

/** @typedef {{ id: string, prefix: string, scopes: string, created_at: number, revoked_at: number | null }} Key */

/**
 * Keys of one owner. `base` is where they are listed and minted: `/admin/tenants/{id}/keys`,
 * `/admin/keys` or a tenant's own `/v1/keys`; `revoke` where one is revoked (`/admin/keys` or
 * `/v1/keys`); `scopes` are those a new key may get, `initial` those ticked at first.
 * @param {{ base: string, revoke?: string, owner: string, scopes: string[], initial: string[] }} props
 */
export function Keys({ base, revoke = '/admin/keys', owner, scopes: allowed, initial }) {
  const [keys, error, reload] = useLoad(() => api('GET', base).then((r) => /** @type {Key[]} */ (r.data)), [base]);
  const [scopes, setScopes] = useState(initial);
  const [secret, setSecret] = useState('');
  const [mintError, setMintError] = useState(/** @type {unknown} */ (null));
  /** @param {Event} e */
  const mint = async (e) => {
    e.preventDefault();
    setMintError(null);
    try {
      const created = await api('POST', base, { scopes });
      setSecret(created.key);
      reload();
    } catch (err) {
      setMintError(err);
    }
  };
  return html`<div class="keys">
    ${secret
      ? html`<${Secret} label=${`New key for ${owner}`} secret=${secret} onDone=${() => setSecret('')} />`
      : html`<form class="row" onSubmit=${mint} aria-label=${`New key for ${owner}`}>
          <fieldset>
            <legend>Scopes</legend>
            ${allowed.map(
              (s) => html`<label><input type="checkbox" checked=${scopes.includes(s)}
                onChange=${(/** @type {any} */ e) => setScopes(e.currentTarget.checked ? [...scopes, s] : scopes.filter((x) => x !== s))} /> ${s}</label>`,
            )}
          </fieldset>
          <button type="submit">Create key</button>
          <${ErrorNote} error=${mintError} />
        </form>`}
    <${ListState} data=${keys} error=${error} empty="No keys." />
    ${keys && keys.length > 0
      ? html`<table aria-label=${`Keys of ${owner}`}>
          <thead><tr><th scope="col">Key</th><th scope="col">Scopes</th><th scope="col">Created</th><th scope="col">Status</th><th scope="col">Actions</th></tr></thead>
          <tbody>
            ${keys.map(
              (k) => html`<tr key=${k.id}>
                <th scope="row"><code>${k.prefix}…</code></th>
                <td>${k.scopes.split(',').join(', ')}</td>
                <td>${new Date(k.created_at).toISOString().slice(0, 16).replace('T', ' ')}</td>
                <td>${k.revoked_at == null ? 'live' : `revoked ${new Date(k.revoked_at).toISOString().slice(0, 10)}`}</td>
                <td>
                  ${k.revoked_at == null
                    ? html`<${ConfirmButton} label="Revoke" question=${`Revoke key ${k.prefix}…? Requests with it are refused at once.`} action="Revoke key"
                        onConfirm=${async () => { await api('DELETE', `${revoke}/${encodeURIComponent(k.id)}`); reload(); }} />`
                    : null}
                </td>
              </tr>`,
            )}
          </tbody>
        </table>`
      : null}
  </div>`;
}

/** The operator's own keys: admin and metrics (a Prometheus server's) scopes. */
export function OperatorKeys() {
  return html`<section>
    <p class="help">Keys with the admin scope manage everything; a metrics key only reads /metrics.</p>
    <${Keys} base="/admin/keys" owner="the operator" scopes=${['admin', 'metrics']} initial=${['metrics']} />
  </section>`;
}
