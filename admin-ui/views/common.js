// @ts-check
/** Pieces every view uses: errors shown in place, confirmations, the once-shown secret. */
import { html, useEffect, useLayoutEffect, useRef, useState } from '../vendor/preact-htm.js';

/**
 * An error from the API (or anything thrown), shown where the action happened.
 * @param {{ error: unknown }} props
 */
export function ErrorNote({ error }) {
  if (!error) return null;
  const message = error instanceof Error ? error.message : String(error);
  const status = /** @type {any} */ (error).status;
  return html`<p class="error" role="alert">${status ? `${status}: ` : ''}${message}</p>`;
}

/**
 * A destructive action asked about in place; focus starts on Cancel.
 * @param {{ question: string, action: string, onConfirm: () => Promise<void> | void, onCancel: () => void }} props
 */
export function Confirm({ question, action, onConfirm, onCancel }) {
  const cancel = useRef(/** @type {HTMLButtonElement | null} */ (null));
  const [busy, setBusy] = useState(false);
  const [error, setError] = useState(/** @type {unknown} */ (null));
  useLayoutEffect(() => cancel.current?.focus(), []);
  const go = async () => {
    setBusy(true);
    setError(null);
    try {
      await onConfirm();
    } catch (e) {
      setError(e);
      setBusy(false);
    }
  };
  return html`<div class="confirm" role="alertdialog" aria-label=${question}>
    <p>${question}</p>
    <button type="button" class="danger" disabled=${busy} onClick=${go}>${action}</button>
    <button type="button" ref=${cancel} onClick=${onCancel}>Cancel</button>
    <${ErrorNote} error=${error} />
  </div>`;
}

/**
 * A secret shown once, with a copy button.
 * @param {{ label: string, secret: string, onDone: () => void }} props
 */
export function Secret({ label, secret, onDone }) {
  const [copied, setCopied] = useState('');
  const field = useRef(/** @type {HTMLInputElement | null} */ (null));
  useLayoutEffect(() => field.current?.focus(), []);
  const copy = async () => {
    try {
      await navigator.clipboard.writeText(secret);
      setCopied('Copied.');
    } catch {
      setCopied('Copy failed: select the key and copy it by hand.');
    }
  };
  return html`<div class="secret" role="status">
    <label for="secret">${label}</label>
    <input id="secret" ref=${field} readonly value=${secret} onFocus=${(/** @type {any} */ e) => e.currentTarget.select()} />
    <button type="button" onClick=${copy}>Copy</button>
    <button type="button" onClick=${onDone}>Done</button>
    <p class="help">This is the only time the key is shown. ${copied}</p>
  </div>`;
}

/**
 * Loads `load()` once and on `reload()`: [data, error, reload].
 * @template T
 * @param {() => Promise<T>} load
 * @returns {[T | undefined, unknown, () => void]}
 */
export function useLoad(load) {
  const [data, setData] = useState(/** @type {T | undefined} */ (undefined));
  const [error, setError] = useState(/** @type {unknown} */ (null));
  const [tick, setTick] = useState(0);
  useEffect(() => {
    let live = true;
    load().then(
      (d) => live && (setData(d), setError(null)),
      (e) => live && setError(e),
    );
    return () => {
      live = false;
    };
  }, [tick]);
  return [data, error, () => setTick((t) => t + 1)];
}
