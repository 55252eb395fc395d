// @ts-check
/** Bar charts drawn by uPlot: stacked series over days, or one series over named categories. */
import { html, useEffect, useRef } from '../vendor/preact-htm.js';
import uPlot from '../vendor/uPlot.esm.js';

/**
 * The y scale of every chart: from zero (a bar is a length; a scale from the smallest value would
 * make a tenant with 170 tokens look five times one with 4,446) to a little past the largest.
 * @param {uPlot} _u @param {number} _min @param {number} max @returns {uPlot.Range.MinMax}
 */
export function yRange(_u, _min, max) {
  return [0, Number.isFinite(max) && max > 0 ? max * 1.05 : 1];
}

/**
 * The y axis's tick labels, each written once: `format`'s, unless it rounds two ticks to the same
 * text (dollars to the cent on a scale of half cents), then as many decimals as the step needs.
 * @param {number[]} splits @param {(v: number) => string} format @returns {string[]}
 */
export function tickLabels(splits, format) {
  const labels = splits.map((v) => format(v));
  if (new Set(labels).size === labels.length) return labels;
  const step = splits.length > 1 ? Math.abs(splits[1] - splits[0]) : 1;
  const decimals = Math.max(0, Math.min(10, -Math.floor(Math.log10(step || 1))));
  return splits.map((v) => v.toFixed(decimals));
}

const COLORS = ['#0b4fa8', '#c2410c', '#15803d', '#7e22ce', '#a16207', '#0e7490', '#be123c', '#4d7c0f'];

/**
 * Bars of several series stacked per x: each series is drawn to the running sum of those
 * before it, tallest first, so each band shows its own share; the legend shows its own values.
 * @param {{ title: string, x: number[], series: { label: string, values: number[] }[], time?: boolean,
 *   categories?: string[], format?: (v: number) => string }} props
 */
export function StackedBars({ title, x, series, time = true, categories, format = (v) => String(v) }) {
  const box = useRef(/** @type {HTMLDivElement | null} */ (null));
  useEffect(() => {
    const el = box.current;
    if (!el || x.length === 0) return;
    const sums = series.map((_, si) => x.map((__, i) => series.slice(0, si + 1).reduce((acc, s) => acc + (s.values[i] ?? 0), 0)));
    const bars = uPlot.paths.bars ? uPlot.paths.bars({ size: [0.6, 64] }) : undefined;
    /** @type {uPlot.Options} */
    const opts = {
      title,
      width: Math.max(320, Math.min(el.clientWidth || 800, 1000)),
      height: 260,
      // Half a step of room on each side of the first and last bar (a day, or a category).
      scales: { x: { time, auto: false, min: x[0] - (time ? 43_200 : 0.5), max: x[x.length - 1] + (time ? 43_200 : 0.5) }, y: { range: yRange } },
      axes: [
        categories
          ? { values: (_u, splits) => splits.map((v) => categories[v] ?? ''), incrs: [1] }
          : time
            ? // Whole days (UTC), labelled as dates.
              { incrs: [86_400, 7 * 86_400, 30 * 86_400, 365 * 86_400], values: (_u, splits) => splits.map((v) => new Date(v * 1000).toISOString().slice(0, 10)) }
            : {},
        { values: (_u, splits) => tickLabels(splits, format), size: 84 },
      ],
      series: [
        {},
        ...series
          .map((s, si) => ({
            label: s.label,
            fill: COLORS[si % COLORS.length],
            stroke: COLORS[si % COLORS.length],
            paths: bars,
            points: { show: false },
            value: (/** @type {uPlot} */ _u, /** @type {number | null} */ _v, /** @type {number} */ _s, /** @type {number | null} */ i) =>
              i == null ? '' : format(s.values[i] ?? 0),
          }))
          .reverse(),
      ],
    };
    const data = /** @type {uPlot.AlignedData} */ ([x, ...sums.reverse()]);
    const plot = new uPlot(opts, data, el);
    return () => plot.destroy();
  }, [title, x, series]);
  return html`<figure class="chart">
    <div ref=${box} role="img" aria-label=${`${title}: bar chart; the same figures are in the table below`}></div>
  </figure>`;
}

/**
 * Lines over time (x in Unix seconds), each series its own color.
 * @param {{ title: string, x: number[], series: { label: string, values: (number | null)[] }[], format?: (v: number) => string }} props
 */
export function Lines({ title, x, series, format = (v) => String(v) }) {
  const box = useRef(/** @type {HTMLDivElement | null} */ (null));
  const plot = useRef(/** @type {uPlot | null} */ (null));
  const labels = series.map((s) => s.label).join('\n');
  useEffect(() => {
    const el = box.current;
    if (!el) return;
    /** @type {uPlot.Options} */
    const opts = {
      title,
      width: Math.max(320, Math.min(el.clientWidth || 600, 640)),
      height: 200,
      scales: { y: { range: yRange } },
      axes: [{}, { values: (_u, splits) => tickLabels(splits, format), size: 60 }],
      series: [{}, ...series.map((s, i) => ({ label: s.label, stroke: COLORS[i % COLORS.length], width: 2 }))],
    };
    plot.current = new uPlot(opts, /** @type {uPlot.AlignedData} */ ([[], ...series.map(() => [])]), el);
    return () => {
      plot.current?.destroy();
      plot.current = null;
    };
  }, [title, labels]);
  useEffect(() => {
    plot.current?.setData(/** @type {uPlot.AlignedData} */ ([x, ...series.map((s) => s.values)]));
  }, [x, series]);
  return html`<figure class="chart">
    <div ref=${box} role="img" aria-label=${`${title}: line chart; the current figures are in the tables`}></div>
  </figure>`;
}
