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
 * A destructive action's button, which asks in place first ([`Confirm`]).
 * @param {{ label: string, question: string, action: string, onConfirm: () => Promise<void> | void }} props
 */
export function ConfirmButton({ label, question, action, onConfirm }) {
  const [open, setOpen] = useState(false);
  const confirm = async () => {
    await onConfirm();
    setOpen(false);
  };
  return html`<button type="button" class="danger" onClick=${() => setOpen(true)}>${label}</button>
    ${open ? html`<${Confirm} question=${question} action=${action} onConfirm=${confirm} onCancel=${() => setOpen(false)} />` : null}`;
}

/**
 * What a list shows before or instead of its rows: the load's error, "Loading…", or `empty`
 * when it has none.
 * @param {{ data: unknown[] | undefined, error: unknown, empty: string }} props
 */
export function ListState({ data, error, empty }) {
  if (error) return html`<${ErrorNote} error=${error} />`;
  if (data === undefined) return html`<p class="loading">Loading…</p>`;
  return data.length === 0 ? html`<p>${empty}</p>` : null;
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
 * Loads `load()` when `deps` change and on `reload()`: [data, error, reload].
 * @template T
 * @param {() => Promise<T>} load
 * @param {unknown[]} [deps]
 * @returns {[T | undefined, unknown, () => void]}
 */
export function useLoad(load, deps = []) {
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
  }, [tick, ...deps]);
  return [data, error, () => setTick((t) => t + 1)];
}

/**
 * A date range picker: `from` and `to` as YYYY-MM-DD, both days included.
 * @param {{ from: string, to: string, onChange: (range: { from: string, to: string }) => void }} props
 */
export function DateRange({ from, to, onChange }) {
  const [f, setF] = useState(from);
  const [t, setT] = useState(to);
  /** @param {Event} e */
  const submit = (e) => {
    e.preventDefault();
    onChange({ from: f, to: t });
  };
  return html`<form class="row" onSubmit=${submit} aria-label="Period">
    <label>From <input type="date" required value=${f} onInput=${(/** @type {any} */ e) => setF(e.currentTarget.value)} /></label>
    <label>To (included) <input type="date" required value=${t} onInput=${(/** @type {any} */ e) => setT(e.currentTarget.value)} /></label>
    <button type="submit">Show</button>
  </form>`;
}

/** @param {number} daysAgo @returns {string} YYYY-MM-DD (UTC) */
export function day(daysAgo = 0) {
  return new Date(Date.now() - daysAgo * 86_400_000).toISOString().slice(0, 10);
}

/**
 * The query string of a period whose `to` day is included (the API's `to` is exclusive).
 * @param {{ from: string, to: string }} range
 */
export function periodQuery(range) {
  const next = new Date(Date.parse(`${range.to}T00:00:00Z`) + 86_400_000).toISOString().slice(0, 10);
  return `from=${encodeURIComponent(range.from)}&to=${encodeURIComponent(next)}`;
}

/** Token counts with thousands separators. @param {number} n */
export function count(n) {
  return Number(n).toLocaleString('en-US');
}

/** Dollars on a chart axis: two significant digits, however small. @param {number} v */
export function dollars(v) {
  return v === 0 ? '0' : Math.abs(v) >= 0.01 ? v.toFixed(2) : v.toPrecision(2);
}

/**
 * @typedef {{ requests: number, prompt_tokens: number, completion_tokens: number, total_tokens: number, cost: string }} Sums
 * @typedef {{ title: string, value: (row: any) => string }} KeyColumn
 */

/**
 * Sums of usage in a table: the columns that name a row (`keys`, the first one a row header),
 * then requests, tokens and cost. With `caption`, the label is shown above it.
 * @param {{ rows: Sums[], keys: KeyColumn[], label: string, caption?: boolean }} props
 */
export function SumsTable({ rows, keys, label, caption = false }) {
  return html`<table class="numbers" aria-label=${caption ? undefined : label}>
    ${caption ? html`<caption>${label}</caption>` : null}
    <thead><tr>${keys.map((k) => html`<th scope="col">${k.title}</th>`)}<th scope="col">Requests</th><th scope="col">Prompt tokens</th>
      <th scope="col">Completion tokens</th><th scope="col">Total tokens</th><th scope="col">Cost ($)</th></tr></thead>
    <tbody>
      ${rows.map(
        (r) => html`<tr>${keys.map((k, i) => (i === 0 ? html`<th scope="row">${k.value(r)}</th>` : html`<td class="key">${k.value(r)}</td>`))}
          <td>${count(r.requests)}</td><td>${count(r.prompt_tokens)}</td><td>${count(r.completion_tokens)}</td><td>${count(r.total_tokens)}</td><td>${r.cost}</td></tr>`,
      )}
    </tbody>
  </table>`;
}

/** An adapter as usage rows name it (`name@version`; empty: the base model). @param {{ adapter?: string }} r */
export const adapterName = (r) => r.adapter || 'base model';

/**
 * The base model an adapter was uploaded for, and, when this server's model cannot use it, why.
 * @param {{ adapter: { base_model: string | null, usable: boolean, unusable_reason: string | null } }} props
 */
export function BaseModelCell({ adapter }) {
  return adapter.usable
    ? html`<td>${adapter.base_model ?? 'unknown'}</td>`
    : html`<td class="bad" title=${adapter.unusable_reason ?? ''}>${adapter.base_model ?? 'unknown'}: cannot be used with this server's base model</td>`;
}
