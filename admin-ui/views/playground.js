// @ts-check
/**
 * The playground: one prompt, streamed from a chosen adapter (own or published) and, side by
 * side, from the base model, with the sampling controls of the completions API.
 */
import { html, useRef, useState } from '../vendor/preact-htm.js';
import { api, stream } from '../api.js';
import { ErrorNote, useLoad } from './common.js';

/** @typedef {{ text: string, error: unknown, running: boolean, usage: any }} Output */

/** @param {{ title: string, out: Output }} props */
function Pane({ title, out }) {
  return html`<section class="pane" aria-label=${title} aria-busy=${out.running}>
    <h2>${title}</h2>
    <pre class="output" aria-live="polite">${out.text}</pre>
    ${out.usage ? html`<p class="help">${out.usage.prompt_tokens} prompt tokens, ${out.usage.completion_tokens} completion tokens</p>` : null}
    <${ErrorNote} error=${out.error} />
  </section>`;
}

/** @param {string} name @param {string} value @param {(v: string) => void} set @param {Record<string, string>} attrs */
function numberField(name, value, set, attrs) {
  return html`<label>${name} <input type="number" value=${value} ...${attrs} onInput=${(/** @type {any} */ e) => set(e.currentTarget.value)} /></label>`;
}

export function Playground() {
  const [models, modelsError] = useLoad(() => api('GET', '/v1/models').then((r) => /** @type {{ id: string }[]} */ (r.data)));
  const [adapter, setAdapter] = useState('');
  const [prompt, setPrompt] = useState('Once upon a time');
  const [maxTokens, setMaxTokens] = useState('32');
  const [temperature, setTemperature] = useState('0');
  const [topP, setTopP] = useState('1');
  const [seed, setSeed] = useState('');
  const empty = /** @type {Output} */ ({ text: '', error: null, running: false, usage: null });
  const [left, setLeft] = useState(empty);
  const [right, setRight] = useState(empty);
  const abort = useRef(/** @type {AbortController | null} */ (null));
  const base = models?.[0]?.id ?? '';
  const chosen = adapter || base;
  /**
   * @param {string} model
   * @param {(f: (o: Output) => Output) => void} set
   * @param {AbortSignal} signal
   */
  const run = async (model, set, signal) => {
    set(() => ({ text: '', error: null, running: true, usage: null }));
    /** @type {Record<string, unknown>} */
    const body = { model, prompt, max_tokens: Number(maxTokens), temperature: Number(temperature), top_p: Number(topP), stream_options: { include_usage: true } };
    if (seed.trim() !== '') body.seed = Number(seed);
    try {
      await stream(
        '/v1/completions',
        body,
        (e) => set((o) => ({ ...o, text: o.text + (e.choices?.[0]?.text ?? ''), usage: e.usage ?? o.usage })),
        signal,
      );
      set((o) => ({ ...o, running: false }));
    } catch (err) {
      set((o) => ({ ...o, running: false, error: signal.aborted ? new Error('Stopped.') : err }));
    }
  };
  /** @param {Event} e */
  const submit = (e) => {
    e.preventDefault();
    abort.current?.abort();
    const controller = new AbortController();
    abort.current = controller;
    run(chosen, setLeft, controller.signal);
    if (chosen !== base) run(base, setRight, controller.signal);
    else setRight(empty);
  };
  const running = left.running || right.running;
  return html`<section>
    <${ErrorNote} error=${modelsError} />
    <form onSubmit=${submit} aria-label="Prompt">
      <label>Model <select value=${adapter} onChange=${(/** @type {any} */ e) => setAdapter(e.currentTarget.value)}>
        <option value="">${base ? `${base} (base model)` : 'base model'}</option>
        ${(models ?? []).slice(1).map((m) => html`<option value=${m.id}>${m.id}</option>`)}
      </select></label>
      <label class="wide">Prompt <textarea rows="4" required value=${prompt} onInput=${(/** @type {any} */ e) => setPrompt(e.currentTarget.value)}></textarea></label>
      <div class="row">
        ${numberField('Max tokens', maxTokens, setMaxTokens, { min: '1', max: '4096', step: '1', required: 'true' })}
        ${numberField('Temperature', temperature, setTemperature, { min: '0', max: '2', step: '0.1', required: 'true' })}
        ${numberField('Top p', topP, setTopP, { min: '0.01', max: '1', step: '0.01', required: 'true' })}
        ${numberField('Seed', seed, setSeed, { min: '0', step: '1', placeholder: 'random' })}
      </div>
      <button type="submit" disabled=${!base}>${running ? 'Restart' : 'Run'}</button>
      ${running ? html`<button type="button" onClick=${() => abort.current?.abort()}>Stop</button>` : null}
    </form>
    <div class="panes">
      <${Pane} title=${chosen === base ? 'Base model' : chosen} out=${left} />
      ${chosen !== base ? html`<${Pane} title="Base model, same prompt" out=${right} />` : null}
    </div>
  </section>`;
}
