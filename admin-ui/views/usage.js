// @ts-check
/** A tenant's own usage and cost: per day and per adapter, charts and tables. */
import { html, useMemo, useState } from '../vendor/preact-htm.js';
import { api } from '../api.js';
import { DateRange, ErrorNote, SumsTable, adapterName, count, day, dollars, periodQuery, useLoad } from './common.js';
import { StackedBars } from './chart.js';

/** @typedef {import('./common.js').Sums & { date?: string, adapter?: string }} Row */

/** @type {import('./common.js').KeyColumn[]} */
const BY_DATE = [{ title: 'Date', value: (r) => r.date }];
/** @type {import('./common.js').KeyColumn[]} */
const BY_ADAPTER = [{ title: 'Adapter', value: adapterName }];

export function Usage() {
  const [range, setRange] = useState({ from: day(30), to: day(0) });
  const q = periodQuery(range);
  const [byDay, dayError] = useLoad(() => api('GET', `/v1/usage?${q}&group_by=day`), [q]);
  const [byAdapter, adapterError] = useLoad(() => api('GET', `/v1/usage?${q}&group_by=adapter`), [q]);
  const days = useMemo(() => {
    /** @type {Row[]} */
    const rows = byDay?.data ?? [];
    return {
      x: rows.map((r) => Date.parse(`${r.date}T00:00:00Z`) / 1000),
      tokens: [{ label: 'tokens', values: rows.map((r) => r.total_tokens) }],
      cost: [{ label: 'cost', values: rows.map((r) => Number(r.cost)) }],
    };
  }, [byDay]);
  const adapters = useMemo(() => {
    /** @type {Row[]} */
    const rows = byAdapter?.data ?? [];
    return { names: rows.map(adapterName), x: rows.map((_, i) => i), tokens: [{ label: 'tokens', values: rows.map((r) => r.total_tokens) }] };
  }, [byAdapter]);
  return html`<section>
    <${DateRange} from=${range.from} to=${range.to} onChange=${setRange} />
    <${ErrorNote} error=${dayError || adapterError} />
    ${byDay && byDay.data.length === 0 ? html`<p>No usage in this period.</p>` : null}
    ${byDay && byDay.data.length > 0
      ? html`<h2>Per day</h2>
          <p>Total: ${count(byDay.totals.total_tokens)} tokens, $${byDay.totals.cost}.</p>
          <div class="charts">
            <${StackedBars} title="Tokens per day" x=${days.x} series=${days.tokens} format=${count} />
            <${StackedBars} title="Cost per day ($)" x=${days.x} series=${days.cost} format=${dollars} />
          </div>
          <${SumsTable} rows=${byDay.data} keys=${BY_DATE} label="Usage per day" />`
      : null}
    ${byAdapter && byAdapter.data.length > 0
      ? html`<h2>Per adapter</h2>
          <${StackedBars} title="Tokens per adapter" x=${adapters.x} series=${adapters.tokens} time=${false} categories=${adapters.names} format=${count} />
          <${SumsTable} rows=${byAdapter.data} keys=${BY_ADAPTER} label="Usage per adapter" />`
      : null}
  </section>`;
}
