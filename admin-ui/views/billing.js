// @ts-check
/**
 * The operator's bills for a period: tokens and cost per day by tenant (charts), the sums per
 * tenant, per adapter and per day, and the full report table, which the CSV equals.
 */
import { html, useMemo, useState } from '../vendor/preact-htm.js';
import { api, download } from '../api.js';
import { DateRange, ErrorNote, SumsTable, adapterName, count, day, dollars, periodQuery, useLoad } from './common.js';
import { StackedBars } from './chart.js';

/**
 * @typedef {{ requests: number, prompt_tokens: number, cached_prompt_tokens: number, completion_tokens: number,
 *   total_tokens: number, cost: string }} Totals
 * @typedef {Totals & { tenant_id: string, tenant: string, plan: string, adapter: string, date: string }} Line
 * @typedef {Totals & { tenant_id: string, tenant: string }} TenantTotal
 * @typedef {Totals & { tenant_id: string, tenant: string, adapter: string }} AdapterTotal
 * @typedef {Totals & { date: string }} DayTotal
 * @typedef {{ lines: Line[], tenants: TenantTotal[], adapters: AdapterTotal[], days: DayTotal[], totals: Totals }} Report
 */

/** @type {import('./common.js').KeyColumn[]} */
const BY_TENANT = [{ title: 'Tenant', value: (r) => r.tenant }];
/** @type {import('./common.js').KeyColumn[]} */
const BY_ADAPTER = [
  { title: 'Adapter', value: adapterName },
  { title: 'Tenant', value: (r) => r.tenant },
];
/** @type {import('./common.js').KeyColumn[]} */
const BY_DAY = [{ title: 'Date', value: (r) => r.date }];

/** The report's rows as the CSV has them: lines, then each tenant's totals, then the total. @param {Report} r */
export function reportRows(r) {
  /** @param {string} tenant @param {string} plan @param {string} adapter @param {string} date @param {Totals} t */
  const row = (tenant, plan, adapter, date, t) => [tenant, plan, adapter, date, t.requests, t.prompt_tokens, t.cached_prompt_tokens, t.completion_tokens, t.total_tokens, t.cost].map(String);
  return [
    ...r.lines.map((l) => row(l.tenant, l.plan, l.adapter, l.date, l)),
    ...r.tenants.map((t) => row(t.tenant, '*', '*', '*', t)),
    row('*', '*', '*', '*', r.totals),
  ];
}

const HEAD = ['Tenant', 'Plan', 'Adapter', 'Date', 'Requests', 'Prompt tokens', 'Cached prompt tokens', 'Completion tokens', 'Total tokens', 'Cost ($)'];

/** Per day, per tenant: [x (Unix seconds of each day), series]. @param {Line[]} lines @param {(l: Line) => number} pick */
function perDay(lines, pick) {
  const days = [...new Set(lines.map((l) => l.date))].sort();
  const tenants = [...new Set(lines.map((l) => l.tenant))].sort();
  const x = days.map((d) => Date.parse(`${d}T00:00:00Z`) / 1000);
  const series = tenants.map((t) => ({
    label: t,
    values: days.map((d) => lines.filter((l) => l.tenant === t && l.date === d).reduce((a, l) => a + pick(l), 0)),
  }));
  return { x, series };
}

export function Billing() {
  const [range, setRange] = useState({ from: day(30), to: day(0) });
  const [report, error] = useLoad(() => api('GET', `/admin/billing/report?${periodQuery(range)}`).then((r) => /** @type {Report} */ (r)), [range]);
  const [csvError, setCsvError] = useState(/** @type {unknown} */ (null));
  const tokens = useMemo(() => (report ? perDay(report.lines, (l) => l.total_tokens) : null), [report]);
  const cost = useMemo(() => (report ? perDay(report.lines, (l) => Number(l.cost)) : null), [report]);
  const csv = async () => {
    setCsvError(null);
    try {
      await download(`/admin/billing/report?${periodQuery(range)}&format=csv`, `billing-${range.from}-${range.to}.csv`);
    } catch (e) {
      setCsvError(e);
    }
  };
  return html`<section>
    <${DateRange} from=${range.from} to=${range.to} onChange=${setRange} />
    <${ErrorNote} error=${error} />
    ${report === undefined && !error ? html`<p class="loading">Loading…</p>` : null}
    ${report && report.lines.length === 0 ? html`<p>No usage in this period.</p>` : null}
    ${report && report.lines.length > 0 && tokens && cost
      ? html`<div class="charts">
          <${StackedBars} title="Tokens per day, by tenant" x=${tokens.x} series=${tokens.series} format=${count} />
          <${StackedBars} title="Cost per day, by tenant ($)" x=${cost.x} series=${cost.series} format=${dollars} />
        </div>`
      : null}
    ${report && report.lines.length > 0
      ? html`<h2>Sums</h2>
          <div class="sums">
            <${SumsTable} rows=${report.tenants} keys=${BY_TENANT} label="Per tenant" caption />
            <${SumsTable} rows=${report.adapters} keys=${BY_ADAPTER} label="Per adapter" caption />
            <${SumsTable} rows=${report.days} keys=${BY_DAY} label="Per day" caption />
          </div>`
      : null}
    ${report
      ? html`<h2>Report</h2>
          <p class="help">One row per tenant, adapter and day, then each tenant's totals and the total (rows marked *), as in the CSV.</p>
          <button type="button" onClick=${csv}>Download CSV</button>
          <${ErrorNote} error=${csvError} />
          <table class="numbers" aria-label="Billing report">
            <thead><tr>${HEAD.map((h) => html`<th scope="col">${h}</th>`)}</tr></thead>
            <tbody>
              ${reportRows(report).map(
                (r, i) => html`<tr key=${i} class=${r[2] === '*' ? 'subtotal' : ''}>${r.map((c, j) => (j === 0 ? html`<th scope="row">${c}</th>` : html`<td class=${j < 4 ? 'key' : ''}>${c}</td>`))}</tr>`,
              )}
            </tbody>
          </table>`
      : null}
  </section>`;
}
