// @ts-check
/**
 * A tenant's adapters: upload (drop the two files or the adapter's folder; a progress bar; the
 * server's validation error next to the file it is about), the list with versions, load,
 * unload and delete.
 */
import { html, useState } from '../vendor/preact-htm.js';
import { api, upload } from '../api.js';
import { BaseModelCell, ConfirmButton, ErrorNote, ListState, useLoad } from './common.js';

const CONFIG = 'adapter_config.json';
const WEIGHTS = 'adapter_model.safetensors';

/**
 * The files of a drop: plain files, or the entries of dropped folders (one level).
 * @param {DataTransfer} dt
 * @returns {Promise<File[]>}
 */
async function droppedFiles(dt) {
  /** @type {File[]} */
  const out = [];
  const entries = [...dt.items].map((i) => i.webkitGetAsEntry?.()).filter((e) => e != null);
  if (entries.length === 0) return [...dt.files];
  /** @param {FileSystemFileEntry} e @returns {Promise<File>} */
  const file = (e) => new Promise((resolve, reject) => e.file(resolve, reject));
  for (const entry of entries) {
    if (entry.isFile) out.push(await file(/** @type {FileSystemFileEntry} */ (entry)));
    else if (entry.isDirectory) {
      const reader = /** @type {FileSystemDirectoryEntry} */ (entry).createReader();
      /** @type {FileSystemEntry[]} */
      const children = await new Promise((resolve, reject) => reader.readEntries(resolve, reject));
      for (const c of children) if (c.isFile) out.push(await file(/** @type {FileSystemFileEntry} */ (c)));
    }
  }
  return out;
}

/**
 * Which file a refusal is about: the weights, the config, or neither (the form, a quota).
 * @param {string} message
 * @returns {'config' | 'weights' | null}
 */
export function fileOf(message) {
  if (message.includes(WEIGHTS) || message.includes('`weights`') || /tensor/.test(message)) return 'weights';
  if (message.includes(CONFIG) || message.includes('`config`')) return 'config';
  return null;
}

/** @param {{ onUploaded: () => void }} props */
function Upload({ onUploaded }) {
  const [name, setName] = useState('');
  const [config, setConfig] = useState(/** @type {File | null} */ (null));
  const [weights, setWeights] = useState(/** @type {File | null} */ (null));
  const [progress, setProgress] = useState(/** @type {number | null} */ (null));
  const [error, setError] = useState(/** @type {any} */ (null));
  const [done, setDone] = useState('');
  const [over, setOver] = useState(false);
  /** @param {File[]} files */
  const take = (files) => {
    setError(null);
    setDone('');
    for (const f of files) {
      if (f.name === CONFIG || (f.name.endsWith('.json') && !files.some((g) => g.name === CONFIG))) setConfig(f);
      else if (f.name.endsWith('.safetensors')) setWeights(f);
    }
    const dir = files[0]?.webkitRelativePath?.split('/')[0];
    if (!name && dir) setName(dir);
  };
  /** @param {DragEvent} e */
  const drop = async (e) => {
    e.preventDefault();
    setOver(false);
    if (e.dataTransfer) take(await droppedFiles(e.dataTransfer));
  };
  /** @param {Event} e */
  const submit = async (e) => {
    e.preventDefault();
    setError(null);
    setDone('');
    if (!config || !weights) {
      setError(new Error(`Choose both files: ${CONFIG} and ${WEIGHTS}.`));
      return;
    }
    const form = new FormData();
    form.append('name', name);
    form.append('config', config, CONFIG);
    form.append('weights', weights, WEIGHTS);
    setProgress(0);
    try {
      const made = await upload('/v1/adapters', form, setProgress);
      setDone(`Uploaded ${made.name}, version ${made.version}.`);
      onUploaded();
    } catch (err) {
      setError(err);
      setProgress(null);
    }
  };
  const where = error ? fileOf(String(error.message)) : null;
  /** @param {'config' | 'weights'} which @param {File | null} f */
  const fileRow = (which, f) => html`<li>
    <span class="file">${which === 'config' ? CONFIG : WEIGHTS}:</span> ${f ? `${f.name} (${f.size.toLocaleString('en-US')} bytes)` : 'not chosen'}
    ${where === which ? html`<${ErrorNote} error=${error} />` : null}
  </li>`;
  return html`<form onSubmit=${submit} aria-label="Upload an adapter">
    <label>Name <input required value=${name} onInput=${(/** @type {any} */ e) => setName(e.currentTarget.value)} /></label>
    <div class=${`drop ${over ? 'over' : ''}`} onDragOver=${(/** @type {DragEvent} */ e) => { e.preventDefault(); setOver(true); }}
      onDragLeave=${() => setOver(false)} onDrop=${drop}>
      <p>Drop ${CONFIG} and ${WEIGHTS} (or the adapter's folder) here, or choose them:</p>
      <label>Files <input type="file" multiple accept=".json,.safetensors"
        onChange=${(/** @type {any} */ e) => take([...e.currentTarget.files])} /></label>
    </div>
    <ul class="files">${fileRow('config', config)}${fileRow('weights', weights)}</ul>
    ${progress !== null
      ? html`<p><label>Upload <progress max="100" value=${Math.round(progress * 100)}>${Math.round(progress * 100)}%</progress></label>
          ${Math.round(progress * 100)}%</p>`
      : null}
    <button type="submit">Upload</button>
    ${error && where === null ? html`<${ErrorNote} error=${error} />` : null}
    ${done ? html`<p role="status">${done}</p>` : null}
  </form>`;
}

/** @typedef {{ id: string, name: string, version: number, owner: string | null, public: boolean, rank: number, targets: string[], bytes: number,
 *   content_hash: string, created_at: number, base_model: string | null, usable: boolean, unusable_reason: string | null }} Adapter */

/** Every live version of one adapter, newest first, read when opened. @param {{ name: string }} props */
function Versions({ name }) {
  const [versions, error] = useLoad(
    () => api('GET', `/v1/adapters/${encodeURIComponent(name)}`).then((r) => /** @type {Adapter[]} */ (r.versions).slice().sort((a, b) => b.version - a.version)),
    [name],
  );
  return html`<${ListState} data=${versions} error=${error} empty="No versions." />
    ${versions && versions.length > 0
      ? html`<table aria-label=${`Versions of ${name}`}>
          <thead><tr><th scope="col">Version</th><th scope="col">Uploaded</th><th scope="col">Rank</th><th scope="col">Targets</th>
            <th scope="col">Size</th><th scope="col">Content hash</th></tr></thead>
          <tbody>
            ${versions.map(
              (v) => html`<tr key=${v.id}>
                <th scope="row">${v.version}</th>
                <td>${new Date(v.created_at).toISOString().slice(0, 16).replace('T', ' ')}</td>
                <td>${v.rank}</td>
                <td>${v.targets.join(', ')}</td>
                <td>${(v.bytes / 1e6).toFixed(2)} MB</td>
                <td><code>${v.content_hash.slice(0, 12)}</code></td>
              </tr>`,
            )}
          </tbody>
        </table>`
      : null}`;
}

export function MyAdapters() {
  const [adapters, error, reload] = useLoad(() => api('GET', '/v1/adapters').then((r) => /** @type {Adapter[]} */ (r.data)));
  // The caller's tenant id (usage names it): its own adapters are the ones it may delete.
  const [me] = useLoad(() => api('GET', `/v1/usage?from=${new Date().toISOString().slice(0, 10)}`).then((r) => /** @type {string} */ (r.tenant_id)));
  const [note, setNote] = useState(/** @type {{ name: string, text: string } | null} */ (null));
  const [actionError, setActionError] = useState(/** @type {{ name: string, error: unknown } | null} */ (null));
  const [open, setOpen] = useState(/** @type {string | null} */ (null));
  /** @param {string} name @param {'load' | 'unload'} what */
  const act = async (name, what) => {
    setActionError(null);
    setNote(null);
    try {
      const r = await api('POST', `/v1/adapters/${encodeURIComponent(name)}/${what}`);
      setNote({ name, text: what === 'load' ? (r.held ? 'Loaded and kept in the pool.' : 'Still on its way into the pool: load it again in a moment to keep it there.') : r.released ? 'Released: it may be evicted again.' : 'It was not held.' });
    } catch (e) {
      setActionError({ name, error: e });
    }
  };
  return html`<section>
    <h2>Upload</h2>
    <${Upload} onUploaded=${reload} />
    <h2>Adapters you can use</h2>
    <${ListState} data=${adapters} error=${error} empty="No adapters yet." />
    ${adapters && adapters.length > 0
      ? html`<table aria-label="Adapters">
          <thead><tr><th scope="col">Name</th><th scope="col">Version</th><th scope="col">Rank</th><th scope="col">Targets</th>
            <th scope="col">Size</th><th scope="col">Published</th><th scope="col">Base model</th><th scope="col">Actions</th></tr></thead>
          <tbody>
            ${adapters.map(
              (a) => html`<tr key=${a.id}>
                <th scope="row" class="name">${a.name}</th>
                <td>${a.version}</td>
                <td>${a.rank}</td>
                <td>${a.targets.join(', ')}</td>
                <td>${(a.bytes / 1e6).toFixed(2)} MB</td>
                <td>${a.public ? 'yes' : 'no'}</td>
                <${BaseModelCell} adapter=${a} />
                <td class="actions">
                  <button type="button" aria-expanded=${open === a.name} onClick=${() => setOpen(open === a.name ? null : a.name)}>Versions</button>
                  <button type="button" onClick=${() => act(a.name, 'load')}>Load</button>
                  <button type="button" onClick=${() => act(a.name, 'unload')}>Unload</button>
                  ${a.owner !== me
                    ? null
                    : html`<${ConfirmButton} label="Delete" question=${`Delete ${a.name} and all its versions? Requests already running finish on theirs.`}
                        action="Delete adapter" onConfirm=${async () => { await api('DELETE', `/v1/adapters/${encodeURIComponent(a.name)}`); reload(); }} />`}
                  ${note && note.name === a.name ? html`<p role="status">${note.text}</p>` : null}
                  ${actionError && actionError.name === a.name ? html`<${ErrorNote} error=${actionError.error} />` : null}
                </td>
              </tr>
              ${open === a.name ? html`<tr key=${`${a.id}-versions`}><td colspan="8"><${Versions} name=${a.name} /></td></tr>` : null}`,
            )}
          </tbody>
        </table>`
      : null}
  </section>`;
}
