// @ts-check
/**
 * The operator's live dashboard, read from `/admin/stats` every few seconds: requests running
 * and waiting, tokens/s, recent TTFT and TPOT percentiles, pool pages by kind, evictions,
 * adapter loads by tier, each worker's health.
 */
import { html, useEffect, useState } from '../vendor/preact-htm.js';
import { api } from '../api.js';
import { ErrorNote, count } from './common.js';
import { Lines } from './chart.js';

/** Seconds between reads. */
export const REFRESH_SECONDS = 3;
/** Samples kept (the charts' window: five minutes). */
const KEEP = 100;
/** The window of the latency percentiles. */
const WINDOW_SECONDS = 60;

/** @typedef {{ le: number[], cumulative: number[], count: number, sum: number }} Histogram */
/** @typedef {{ at_ms: number, requests: Record<string, number>, ttft_seconds: Histogram, tpot_seconds: Histogram, workers: any[] }} Stats */

/**
 * The `q` quantile of the observations between two reads of a histogram: the upper bound of the
 * bucket it falls in (`null`: none in between; `Infinity`: past the last bound).
 * @param {Histogram} now @param {Histogram | undefined} before @param {number} q
 * @returns {number | null}
 */
export function quantile(now, before, q) {
  const total = now.count - (before?.count ?? 0);
  if (total <= 0) return null;
  for (let i = 0; i < now.le.length; i++) {
    if (now.cumulative[i] - (before?.cumulative[i] ?? 0) >= q * total) return now.le[i];
  }
  return Infinity;
}

/** @param {number | null} v */
function seconds(v) {
  if (v === null) return '–';
  if (v === Infinity) return 'past the last bucket';
  return v < 1 ? `≤ ${Math.round(v * 1000)} ms` : `≤ ${v} s`;
}

/** The pool's pages in use by what holds them, as the chart names them (free pages are in the table). */
const POOL_KINDS = [
  ['KV', 'kv'],
  ['adapters', 'adapter'],
  ['prefix cache', 'cached'],
];

/** @param {Stats} s @param {(w: any) => number} f */
const sum = (s, f) => s.workers.reduce((a, w) => a + f(w), 0);

export function Dashboard() {
  const [samples, setSamples] = useState(/** @type {Stats[]} */ ([]));
  const [error, setError] = useState(/** @type {unknown} */ (null));
  useEffect(() => {
    let live = true;
    const read = async () => {
      try {
        const s = /** @type {Stats} */ (await api('GET', '/admin/stats'));
        if (!live) return;
        setError(null);
        setSamples((old) => [...old.slice(-(KEEP - 1)), s]);
      } catch (e) {
        if (live) setError(e);
      }
    };
    read();
    const timer = setInterval(read, REFRESH_SECONDS * 1000);
    return () => {
      live = false;
      clearInterval(timer);
    };
  }, []);
  const now = samples.at(-1);
  if (!now) return html`<section><${ErrorNote} error=${error} /><p class="loading">Reading the server's state…</p></section>`;
  const since = samples.find((s) => s.at_ms >= now.at_ms - WINDOW_SECONDS * 1000) ?? samples[0];
  const before = since === now ? undefined : since;
  const x = samples.map((s) => s.at_ms / 1000);
  /** Tokens generated per second between consecutive reads. */
  const rates = samples.map((s, i) => {
    const p = samples[i - 1];
    if (!p) return null;
    const dt = (s.at_ms - p.at_ms) / 1000;
    return dt > 0 ? (sum(s, (w) => w.generated_tokens) - sum(p, (w) => w.generated_tokens)) / dt : null;
  });
  const rate = rates.at(-1);
  const latency = [
    ['Time to first token', now.ttft_seconds, before?.ttft_seconds],
    ['Time per output token', now.tpot_seconds, before?.tpot_seconds],
  ];
  return html`<section>
    <p class="help">Read every ${REFRESH_SECONDS} s.</p>
    <${ErrorNote} error=${error} />
    <dl class="figures" aria-label="Now">
      <div><dt>Running</dt><dd>${sum(now, (w) => w.running)}</dd></div>
      <div><dt>Waiting</dt><dd>${sum(now, (w) => w.waiting)}</dd></div>
      <div><dt>Tokens/s</dt><dd>${rate == null ? '–' : rate.toFixed(1)}</dd></div>
      <div><dt>Requests finished</dt><dd>${count(Object.values(now.requests).reduce((a, n) => a + n, 0))}</dd></div>
    </dl>
    <div class="charts">
      <${Lines} title="Tokens per second" x=${x} series=${[{ label: 'tokens/s', values: rates }]} format=${(/** @type {number} */ v) => v.toFixed(0)} />
      <${Lines} title="Requests" x=${x}
        series=${[{ label: 'running', values: samples.map((s) => sum(s, (w) => w.running)) }, { label: 'waiting', values: samples.map((s) => sum(s, (w) => w.waiting)) }]} />
      <${Lines} title="Pool pages in use, every worker" x=${x}
        series=${POOL_KINDS.map(([label, kind]) => ({ label, values: samples.map((s) => sum(s, (w) => w.pool[kind])) }))} />
    </div>
    <h2>Latency</h2>
    <p class="help">Percentiles ${before ? `over the last ${Math.round((now.at_ms - since.at_ms) / 1000)} s` : 'since the server started'}, as the upper
      bound of the histogram bucket they fall in.</p>
    <table aria-label="Latency percentiles">
      <thead><tr><th scope="col">Measure</th><th scope="col">p50</th><th scope="col">p90</th><th scope="col">p99</th><th scope="col">Requests</th></tr></thead>
      <tbody>
        ${latency.map(
          ([name, h, b]) => html`<tr><th scope="row">${name}</th>
            <td>${seconds(quantile(/** @type {Histogram} */ (h), /** @type {Histogram | undefined} */ (b), 0.5))}</td>
            <td>${seconds(quantile(/** @type {Histogram} */ (h), /** @type {Histogram | undefined} */ (b), 0.9))}</td>
            <td>${seconds(quantile(/** @type {Histogram} */ (h), /** @type {Histogram | undefined} */ (b), 0.99))}</td>
            <td>${/** @type {Histogram} */ (h).count - (/** @type {Histogram | undefined} */ (b)?.count ?? 0)}</td></tr>`,
        )}
      </tbody>
    </table>
    <h2>Workers</h2>
    <table class="numbers" aria-label="Workers">
      <thead><tr><th scope="col">Worker</th><th scope="col">Health</th><th scope="col">Running</th><th scope="col">Waiting</th>
        <th scope="col">Pages: KV</th><th scope="col">adapters</th><th scope="col">prefix cache</th><th scope="col">free</th><th scope="col">total</th>
        <th scope="col">Evictions (adapters)</th><th scope="col">Adapter loads: host</th><th scope="col">disk</th><th scope="col">failed</th>
        <th scope="col">Restarts</th></tr></thead>
      <tbody>
        ${now.workers.map(
          (w) => html`<tr>
            <th scope="row">${w.worker} (${w.device})</th>
            <td class=${w.unhealthy ? 'bad' : 'good'}>${w.unhealthy ? `unhealthy: ${w.unhealthy}` : 'healthy'}</td>
            <td>${w.running}</td><td>${w.waiting}</td>
            <td>${w.pool.kv}</td><td>${w.pool.adapter}</td><td>${w.pool.cached}</td><td>${w.pool.free}</td><td>${w.pool.total}</td>
            <td>${w.pool.evictions} (${w.pool.adapter_evictions})</td>
            <td>${w.adapters.loads_from_host}</td><td>${w.adapters.loads_from_disk}</td><td>${w.adapters.failures}</td>
            <td>${w.restarts}</td>
          </tr>`,
        )}
      </tbody>
    </table>
  </section>`;
}
