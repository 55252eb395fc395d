// Drives the admin console in headless Chromium against a running server:
//   node e2e.mjs BASE_URL ADMIN_KEY OUT_DIR
// The operator signs in, creates tenants (a name made of markup is refused and the refusal
// shows it literally), edits limits, mints a key and deletes a tenant after confirming; the
// tenant signs in with the minted key and sees its usage; the operator sees the bill equal to it
// and downloads a CSV equal to the table; a wrong key gets the server's error in place. Every view is checked
// with axe-core (no serious or critical violations) and saved as a screenshot under OUT_DIR;
// any Content-Security-Policy violation, page error or browser dialog fails the run.
import { readFileSync, mkdirSync, writeFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import { chromium } from 'playwright-core';

const [base, adminKey, out, adapterDir] = process.argv.slice(2);
if (!base || !adminKey || !out || !adapterDir) {
  console.error('usage: node e2e.mjs BASE_URL ADMIN_KEY OUT_DIR ADAPTER_DIR (a PEFT adapter for the served model)');
  process.exit(2);
}
mkdirSync(out, { recursive: true });
const require = createRequire(import.meta.url);
const axeSource = readFileSync(require.resolve('axe-core/axe.min.js'), 'utf8');
const XSS = '<img src=x onerror=alert(1)>';

const problems = [];
const browser = await chromium.launch({
  executablePath: process.env.LORAPLEX_CHROMIUM || '/usr/bin/chromium',
  args: ['--headless', '--no-sandbox'],
});
const context = await browser.newContext({ viewport: { width: 1280, height: 900 } });
const page = await context.newPage();
page.on('pageerror', (e) => problems.push(`page error: ${e.message}`));
page.on('dialog', async (d) => {
  problems.push(`a ${d.type()} dialog opened: ${d.message()}`);
  await d.dismiss();
});
page.on('console', (m) => {
  // The API's refusals (401, 409, 400) are expected and shown in place.
  if (m.type() === 'error' && !/Failed to load resource: the server responded with a status of 40[0139]/.test(m.text())) {
    problems.push(`console error: ${m.text()}`);
  }
});
// Policy violations are reported to the page as events; collect them.
await page.addInitScript(() => {
  // @ts-ignore
  window.__violations = [];
  document.addEventListener('securitypolicyviolation', (e) => {
    // @ts-ignore
    window.__violations.push(`${e.violatedDirective}: ${e.blockedURI}`);
  });
});

const steps = [];
function step(name) {
  steps.push(name);
  console.log(`- ${name}`);
}

async function audit(view) {
  await page.evaluate(axeSource);
  const result = await page.evaluate(async () => {
    // @ts-ignore
    const r = await window.axe.run(document, { resultTypes: ['violations'] });
    return r.violations.map((v) => ({ id: v.id, impact: v.impact, nodes: v.nodes.length, help: v.help }));
  });
  const bad = result.filter((v) => v.impact === 'serious' || v.impact === 'critical');
  for (const v of bad) problems.push(`axe on ${view}: ${v.impact} ${v.id} (${v.nodes} nodes): ${v.help}`);
  await page.screenshot({ path: `${out}/${view}.png`, fullPage: true });
  const list = result.map((v) => `${v.impact} ${v.id}`).join(', ');
  console.log(`  axe on ${view}: ${result.length} violations${list ? ` (${list})` : ''}, ${bad.length} serious or critical; screenshot ${view}.png`);
}

async function expectText(locator, text, what) {
  await locator.filter({ hasText: text }).first().waitFor({ timeout: 10_000 }).catch(() => problems.push(`${what}: "${text}" never showed`));
}

try {
  // First view: the root redirects to the console; time to an interactive sign-in form.
  step('open the console');
  const started = Date.now();
  await page.goto(base + '/');
  await page.getByLabel('API key').waitFor();
  const interactive = Date.now() - started;
  console.log(`  first view interactive after ${interactive} ms (navigation to the sign-in field)`);
  if (!page.url().endsWith('/ui/')) problems.push(`the root led to ${page.url()}, not /ui/`);
  await audit('sign-in');

  step('a wrong key is refused in place');
  await page.getByLabel('API key').fill('not-a-real-key-0123456789');
  await page.getByRole('button', { name: 'Sign in' }).click();
  await expectText(page.getByRole('alert'), '401', 'wrong key');
  await audit('sign-in-refused');

  step('a metrics-only key is told it cannot use the console');
  const metricsKey = (await (await fetch(`${base}/admin/keys`, {
    method: 'POST',
    headers: { Authorization: `Bearer ${adminKey}`, 'Content-Type': 'application/json' },
    body: JSON.stringify({ scopes: ['metrics'] }),
  })).json()).key;
  await page.getByLabel('API key').fill(metricsKey);
  await page.getByRole('button', { name: 'Sign in' }).click();
  await expectText(page.getByRole('alert'), 'neither the admin nor the inference scope', 'metrics key');

  step('the operator signs in');
  await page.getByLabel('API key').fill(adminKey);
  await page.getByRole('button', { name: 'Sign in' }).click();
  await page.getByRole('heading', { name: 'Dashboard', level: 1 }).waitFor();
  await page.getByRole('table', { name: 'Workers' }).getByText('healthy').waitFor();
  await audit('dashboard-idle');
  await page.getByRole('link', { name: 'Tenants' }).click();
  await page.getByRole('heading', { name: 'Tenants', level: 1 }).waitFor();
  if (page.url().includes(adminKey)) problems.push(`the key is in the URL: ${page.url()}`);

  step('create tenants');
  const newTenant = page.getByRole('form', { name: 'New tenant' });
  for (const name of ['acme', 'globex']) {
    await newTenant.getByLabel('Name').fill(name);
    await newTenant.getByRole('button', { name: 'Create tenant' }).click();
    await page.getByRole('rowheader', { name, exact: true }).waitFor();
  }

  step('a name made of markup is refused, and the refusal quoting it shows it as text');
  // Tenant and adapter names are identifiers (the server refuses anything else), so markup
  // reaches the console through what the server says about it: its error quotes the name.
  await newTenant.getByLabel('Name').fill(XSS);
  await newTenant.getByRole('button', { name: 'Create tenant' }).click();
  const refusal = newTenant.getByRole('alert');
  await expectText(refusal, XSS, 'markup-named tenant refusal');
  if ((await page.locator('img').count()) > 0) problems.push('the quoted markup became an <img> element');

  step('a duplicate name shows the server error in place');
  await newTenant.getByLabel('Name').fill('acme');
  await newTenant.getByRole('button', { name: 'Create tenant' }).click();
  await expectText(newTenant.getByRole('alert'), '409', 'duplicate tenant');
  await audit('tenants');

  step('edit acme: requests per minute 60');
  const acme = page.getByRole('row').filter({ has: page.getByRole('rowheader', { name: 'acme', exact: true }) });
  await acme.getByRole('button', { name: 'Edit' }).click();
  const edit = page.getByRole('form', { name: 'Edit acme' });
  await edit.getByLabel('Requests per minute').fill('60');
  await edit.getByLabel('Weight').fill('2');
  await edit.getByRole('button', { name: 'Save' }).click();
  await expectText(acme, 'Requests per minute: 60', 'edited limit');
  await audit('tenant-edited');

  step('mint keys for acme (each shown once), list them, revoke one');
  await acme.getByRole('button', { name: 'Keys' }).click();
  const mintForm = page.getByRole('form', { name: 'New key for acme' });
  /** Mints a key in the open panel; returns its secret. */
  const mint = async () => {
    await mintForm.getByRole('button', { name: 'Create key' }).click();
    const field = page.getByRole('textbox', { name: 'New key for acme' });
    await field.waitFor();
    const value = await field.inputValue();
    return value;
  };
  const tenantKey = await mint();
  if (!tenantKey || tenantKey.length < 16) problems.push(`the minted key looks wrong: ${tenantKey}`);
  await audit('key-minted');
  await page.getByRole('button', { name: 'Done' }).click();
  const spare = await mint();
  await page.getByRole('button', { name: 'Done' }).click();
  const keyTable = page.getByRole('table', { name: 'Keys of acme' });
  const spareRow = keyTable.getByRole('row').filter({ has: page.getByRole('rowheader', { name: `${spare.slice(0, 12)}…` }) });
  await spareRow.waitFor();
  if ((await keyTable.textContent())?.includes(spare)) problems.push('a secret is shown in the key list');
  await spareRow.getByRole('button', { name: 'Revoke' }).click();
  await spareRow.getByRole('alertdialog').getByRole('button', { name: 'Revoke key' }).click();
  await expectText(spareRow, 'revoked', 'revoked key status');
  const refused = await fetch(`${base}/v1/models`, { headers: { Authorization: `Bearer ${spare}` } });
  if (refused.status !== 401) problems.push(`a revoked key got ${refused.status}`);
  await audit('keys');

  step('delete globex after confirming');
  const globex = page.getByRole('row').filter({ has: page.getByRole('rowheader', { name: 'globex', exact: true }) });
  await globex.getByRole('button', { name: 'Delete' }).click();
  const confirm = page.getByRole('alertdialog');
  await confirm.waitFor();
  await page
    .waitForFunction(() => document.activeElement?.textContent === 'Cancel', null, { timeout: 5_000 })
    .catch(async () => problems.push(`the confirmation starts on ${JSON.stringify(await page.evaluate(() => document.activeElement?.textContent))}, not Cancel`));
  await audit('tenant-delete-confirm');
  await confirm.getByRole('button', { name: 'Delete tenant' }).click();
  await page.getByRole('rowheader', { name: 'globex', exact: true }).waitFor({ state: 'detached' });

  step('the tenant signs in with its key');
  await page.getByRole('button', { name: 'Sign out' }).click();
  await page.getByLabel('API key').fill(tenantKey);
  await page.getByRole('button', { name: 'Sign in' }).click();
  await page.getByRole('heading', { name: 'My adapters', level: 1 }).waitFor();
  await expectText(page.locator('main'), 'No adapters yet.', 'tenant adapters');
  await audit('tenant-adapters');

  step('the tenant uploads an adapter by dropping its two files; a progress bar fills');
  const configBytes = readFileSync(`${adapterDir}/adapter_config.json`);
  const weightsBytes = readFileSync(`${adapterDir}/adapter_model.safetensors`);
  const uploadForm = page.getByRole('form', { name: 'Upload an adapter' });
  await uploadForm.getByLabel('Name').fill('support-bot');
  await page.evaluate(
    ([c, w]) => {
      const dt = new DataTransfer();
      dt.items.add(new File([Uint8Array.from(atob(c), (x) => x.charCodeAt(0))], 'adapter_config.json'));
      dt.items.add(new File([Uint8Array.from(atob(w), (x) => x.charCodeAt(0))], 'adapter_model.safetensors'));
      const zone = document.querySelector('.drop');
      zone?.dispatchEvent(new DragEvent('dragover', { dataTransfer: dt, bubbles: true, cancelable: true }));
      zone?.dispatchEvent(new DragEvent('drop', { dataTransfer: dt, bubbles: true, cancelable: true }));
    },
    [configBytes.toString('base64'), weightsBytes.toString('base64')],
  );
  await expectText(uploadForm.getByRole('listitem'), `${weightsBytes.length.toLocaleString('en-US')} bytes`, 'dropped weights');
  await uploadForm.getByRole('button', { name: 'Upload' }).click();
  await expectText(uploadForm.getByRole('status'), 'Uploaded support-bot, version 1.', 'upload');
  const bar = uploadForm.getByRole('progressbar');
  if ((await bar.getAttribute('value')) !== '100') problems.push(`the progress bar ends at ${await bar.getAttribute('value')}`);
  await page.getByRole('rowheader', { name: 'support-bot', exact: true }).waitFor();
  await audit('adapter-uploaded');

  step('the tenant opens the adapter\'s versions');
  const mine = page.getByRole('row').filter({ has: page.getByRole('rowheader', { name: 'support-bot', exact: true }) });
  await mine.getByRole('button', { name: 'Versions' }).click();
  const versions = page.getByRole('table', { name: 'Versions of support-bot' });
  await versions.waitFor();
  const shown = await (await fetch(`${base}/v1/adapters/support-bot`, { headers: { Authorization: `Bearer ${tenantKey}` } })).json();
  const versionRows = await versions.locator('tbody tr').evaluateAll((trs) => trs.map((tr) => [...tr.children].map((c) => c.textContent ?? '')));
  if (versionRows.length !== 1 || versionRows[0][0] !== '1' || versionRows[0][5] !== shown.content_hash.slice(0, 12)) {
    problems.push(`versions ${JSON.stringify(versionRows)}, the API ${JSON.stringify(shown.versions)}`);
  }
  await audit('adapter-versions');
  await mine.getByRole('button', { name: 'Versions' }).click();
  await versions.waitFor({ state: 'detached' });

  step('a refused upload shows the server error next to the weights file, naming the tensor');
  // The same weights with one tensor's shape reversed (the same bytes, a wrong layout).
  const headerLen = Number(weightsBytes.readBigUInt64LE(0));
  const header = JSON.parse(weightsBytes.subarray(8, 8 + headerLen).toString('utf8'));
  const tensor = Object.keys(header).find((k) => k !== '__metadata__' && header[k].shape.length === 2 && header[k].shape[0] !== header[k].shape[1]);
  header[tensor].shape.reverse();
  const newHeader = Buffer.from(JSON.stringify(header), 'utf8');
  const size = Buffer.alloc(8);
  size.writeBigUInt64LE(BigInt(newHeader.length));
  mkdirSync(`${out}/bad`, { recursive: true });
  writeFileSync(`${out}/bad/adapter_model.safetensors`, Buffer.concat([size, newHeader, weightsBytes.subarray(8 + headerLen)]));
  writeFileSync(`${out}/bad/adapter_config.json`, configBytes);
  await uploadForm.getByLabel('Name').fill('broken');
  await uploadForm.getByLabel('Files').setInputFiles([`${out}/bad/adapter_config.json`, `${out}/bad/adapter_model.safetensors`]);
  await uploadForm.getByRole('button', { name: 'Upload' }).click();
  const weightsItem = uploadForm.getByRole('listitem').filter({ hasText: 'adapter_model.safetensors:' });
  await expectText(weightsItem.getByRole('alert'), tensor, 'the refusal naming the tensor');
  console.log(`  refused: ${await weightsItem.getByRole('alert').textContent()}`);
  await audit('adapter-refused');

  step('load the adapter into the pool');
  const botRow = page.getByRole('row').filter({ has: page.getByRole('rowheader', { name: 'support-bot', exact: true }) });
  await botRow.getByRole('button', { name: 'Load', exact: true }).click();
  await expectText(botRow.getByRole('status'), 'Load', 'load');

  step('the playground streams the adapter and the base model side by side');
  await page.getByRole('link', { name: 'Playground' }).click();
  const promptForm = page.getByRole('form', { name: 'Prompt' });
  await promptForm.getByLabel('Model').selectOption('support-bot');
  await promptForm.getByLabel('Prompt').fill('The quick brown fox');
  await promptForm.getByLabel('Max tokens').fill('12');
  await promptForm.getByRole('button', { name: 'Run' }).click();
  const panes = { adapter: page.getByRole('region', { name: 'support-bot' }), base: page.getByRole('region', { name: 'Base model, same prompt' }) };
  // A stream ends with its usage, which the pane then shows.
  for (const pane of Object.values(panes)) await pane.getByText(/completion tokens/).waitFor({ timeout: 30_000 });
  const asTenantJson = { Authorization: `Bearer ${tenantKey}`, 'Content-Type': 'application/json' };
  const modelId = (await (await fetch(`${base}/v1/models`, { headers: asTenantJson })).json()).data[0].id;
  for (const [which, m] of [['adapter', 'support-bot'], ['base', modelId]]) {
    const body = { model: m, prompt: 'The quick brown fox', max_tokens: 12, temperature: 0, top_p: 1 };
    const expected = (await (await fetch(`${base}/v1/completions`, { method: 'POST', headers: asTenantJson, body: JSON.stringify(body) })).json()).choices[0].text;
    const shown = await panes[which].locator('pre').textContent();
    if (shown !== expected) problems.push(`the ${which} pane shows ${JSON.stringify(shown)}, the API answers ${JSON.stringify(expected)}`);
  }
  await audit('playground');

  step('the tenant uses the model; its usage shows per day and per adapter');
  const asTenant = { Authorization: `Bearer ${tenantKey}`, 'Content-Type': 'application/json' };
  const model = (await (await fetch(`${base}/v1/models`, { headers: asTenant })).json()).data[0].id;
  for (const m of [model, 'support-bot']) {
    const r = await fetch(`${base}/v1/completions`, { method: 'POST', headers: asTenant, body: JSON.stringify({ model: m, prompt: 'Hello there', max_tokens: 5 }) });
    if (r.status !== 200) problems.push(`a completion answered ${r.status}: ${await r.text()}`);
  }
  // The ledger is written right after each response; wait until both requests are in it.
  let usage = null;
  for (let i = 0; i < 100; i++) {
    usage = await (await fetch(`${base}/v1/usage`, { headers: asTenant })).json();
    // Two playground streams, the two completions they were checked against, and these two.
    if (usage.totals.requests >= 6) break;
    await new Promise((r) => setTimeout(r, 100));
  }
  await page.getByRole('link', { name: 'Usage' }).click();
  await page.getByRole('heading', { name: 'Usage', level: 1 }).waitFor();
  const perDay = page.getByRole('table', { name: 'Usage per day' });
  await perDay.waitFor();
  const today = new Date().toISOString().slice(0, 10);
  const dayRow = perDay.getByRole('row').filter({ has: page.getByRole('rowheader', { name: today }) });
  const dayCells = await dayRow.getByRole('cell').allTextContents();
  if (dayCells[0] !== String(usage.totals.requests) || dayCells[4] !== usage.totals.cost) {
    problems.push(`usage per day shows ${JSON.stringify(dayCells)}, the API ${JSON.stringify(usage.totals)}`);
  }
  const perAdapter = page.getByRole('table', { name: 'Usage per adapter' });
  await perAdapter.waitFor();
  await perAdapter.getByRole('rowheader', { name: 'support-bot' }).waitFor();
  // The charts are drawn in an effect after the tables render: wait for them rather than count at once.
  await page.locator('.uplot').nth(2).waitFor({ timeout: 5000 }).catch(() => problems.push('the usage charts are missing'));
  await audit('tenant-usage');

  step('the tenant sees its plan, prices and quotas, mints a key of its own and revokes it');
  await page.getByRole('link', { name: 'Account and keys' }).click();
  const prices = page.getByRole('table', { name: 'Prices' });
  await prices.waitFor();
  const priceRows = await prices.locator('tbody tr').evaluateAll((trs) => trs.map((tr) => [...tr.children].map((c) => c.textContent ?? '')));
  // The standard plan: $0.50 / $0.125 / $1.50 per million tokens, half in a batch.
  if (JSON.stringify(priceRows) !== JSON.stringify([['Prompt', '$0.50', '$0.25'], ['Cached prompt', '$0.125', '$0.0625'], ['Completion', '$1.50', '$0.75']])) {
    problems.push(`the tenant's prices: ${JSON.stringify(priceRows)}`);
  }
  const keysQuota = await page.getByRole('table', { name: 'Quotas' }).getByRole('row').filter({ has: page.getByRole('rowheader', { name: 'Live keys' }) }).getByRole('cell').allTextContents();
  if (keysQuota[1] !== '10' || Number(keysQuota[0]) + Number(keysQuota[2]) !== 10 || Number(keysQuota[0]) < 1) problems.push(`the tenant's key quota: ${JSON.stringify(keysQuota)}`);
  const ownForm = page.getByRole('form', { name: 'New key for acme' });
  await ownForm.getByRole('checkbox', { name: 'adapters' }).uncheck();
  await ownForm.getByRole('button', { name: 'Create key' }).click();
  const ownField = page.getByRole('textbox', { name: 'New key for acme' });
  await ownField.waitFor();
  const ownSecret = await ownField.inputValue();
  const asOwn = await fetch(`${base}/v1/me`, { headers: { Authorization: `Bearer ${ownSecret}` } });
  const ownMe = await asOwn.json();
  if (asOwn.status !== 200 || JSON.stringify(ownMe.key.scopes) !== '["inference"]') problems.push(`the tenant's own key: ${asOwn.status} ${JSON.stringify(ownMe.key)}`);
  await audit('tenant-key-minted');
  await page.getByRole('button', { name: 'Done' }).click();
  const ownRow = page.getByRole('table', { name: 'Keys of acme' }).getByRole('row').filter({ hasText: ownSecret.slice(0, 12) });
  await ownRow.getByRole('button', { name: 'Revoke' }).click();
  await ownRow.getByRole('alertdialog').getByRole('button', { name: 'Revoke key' }).click();
  await expectText(ownRow, 'revoked', 'the tenant revoked its own key');
  const afterRevoke = await fetch(`${base}/v1/me`, { headers: { Authorization: `Bearer ${ownSecret}` } });
  if (afterRevoke.status !== 401) problems.push(`the revoked key still answers ${afterRevoke.status}`);
  await audit('tenant-account');

  step('the operator sees the bill equal the usage and downloads the CSV');
  await page.getByRole('button', { name: 'Sign out' }).click();
  await page.getByLabel('API key').fill(adminKey);
  await page.getByRole('button', { name: 'Sign in' }).click();
  await page.getByRole('heading', { name: 'Dashboard', level: 1 }).waitFor();
  await page.getByRole('link', { name: 'Billing' }).click();
  const report = page.getByRole('table', { name: 'Billing report' });
  await report.waitFor();
  const rows = await report.locator('tbody tr').evaluateAll((trs) => trs.map((tr) => [...tr.children].map((c) => c.textContent ?? '')));
  const acmeTotal = rows.find((r) => r[0] === 'acme' && r[2] === '*');
  if (!acmeTotal || acmeTotal[4] !== String(usage.totals.requests) || acmeTotal[8] !== String(usage.totals.total_tokens) || acmeTotal[9] !== usage.totals.cost) {
    problems.push(`acme's bill ${JSON.stringify(acmeTotal)} differs from its usage ${JSON.stringify(usage.totals)}`);
  }
  await page.locator('.uplot').nth(1).waitFor({ timeout: 5000 }).catch(() => problems.push('the billing charts are missing'));
  // The charts' scales start at zero, and their axes write each label once (the console's own
  // functions, as the page loaded them).
  const axes = await page.evaluate(async () => {
    const chart = await import('/ui/views/chart.js');
    const common = await import('/ui/views/common.js');
    return { range: chart.yRange(null, 4450, 4620), cost: chart.tickLabels([0, 0.005, 0.01, 0.015, 0.02], common.dollars) };
  });
  if (axes.range[0] !== 0) problems.push(`a chart's scale starts at ${axes.range[0]}, not 0`);
  if (new Set(axes.cost).size !== axes.cost.length) problems.push(`the cost axis repeats labels: ${JSON.stringify(axes.cost)}`);
  const [file] = await Promise.all([page.waitForEvent('download'), page.getByRole('button', { name: 'Download CSV' }).click()]);
  const csv = readFileSync(await file.path(), 'utf8').trim().split('\n').slice(1).map((line) => line.split(',').slice(1));
  if (JSON.stringify(csv) !== JSON.stringify(rows)) problems.push(`the CSV ${JSON.stringify(csv)} differs from the table ${JSON.stringify(rows)}`);
  console.log(`  billing: ${rows.length} rows, the CSV equal to the table`);
  // The sums per tenant, per adapter and per day each add up to acme's usage (the only tenant that used any).
  const number = (/** @type {string} */ t) => Number(t.replaceAll(',', ''));
  for (const [name, tokensColumn] of [['Per tenant', 4], ['Per adapter', 5], ['Per day', 4]]) {
    const sums = await page.getByRole('table', { name }).locator('tbody tr').evaluateAll((trs) => trs.map((tr) => [...tr.children].map((c) => c.textContent ?? '')));
    const total = sums.reduce((a, r) => a + number(r[tokensColumn]), 0);
    if (sums.length === 0 || total !== usage.totals.total_tokens) problems.push(`${name}: ${JSON.stringify(sums)} adds up to ${total} tokens, not ${usage.totals.total_tokens}`);
  }
  const perAdapterRows = await page.getByRole('table', { name: 'Per adapter' }).locator('tbody th').allTextContents();
  if (!perAdapterRows.includes('support-bot@1') || !perAdapterRows.includes('base model')) problems.push(`per adapter: ${JSON.stringify(perAdapterRows)}`);
  await audit('billing');

  step('the operator sees every adapter (where it is, who pins it) and publishes the tenant\'s');
  await page.getByRole('link', { name: 'Adapters' }).click();
  const every = page.getByRole('table', { name: 'Every adapter' });
  const botAll = every.getByRole('row').filter({ has: page.getByRole('rowheader', { name: 'support-bot', exact: true }) });
  await botAll.waitFor();
  const botCells = await botAll.getByRole('cell').allTextContents();
  // Loaded by the tenant earlier: in the pool, pinned by acme; uploaded for the base model served.
  if (botCells[0] !== 'acme' || botCells[1] !== '1' || botCells[6] !== 'no' || botCells[7] !== 'loraplex-tiny' || botCells[8] !== 'pool' || botCells[9] !== 'acme') {
    problems.push(`support-bot's row: ${JSON.stringify(botCells)}`);
  }
  await botAll.getByRole('button', { name: 'Publish', exact: true }).click();
  await expectText(botAll, 'yes', 'published');
  await botAll.getByRole('button', { name: 'Unpublish', exact: true }).first().click();
  await audit('adapters-unpublish-confirm');
  await botAll.getByRole('alertdialog').getByRole('button', { name: 'Unpublish' }).click();
  await botAll.getByRole('button', { name: 'Publish', exact: true }).waitFor();

  step('the operator pins the adapter, lets its own pin and then the tenant\'s go');
  const pinnedBy = botAll.getByRole('cell').nth(9);
  await botAll.getByRole('button', { name: 'Pin', exact: true }).click();
  await expectText(pinnedBy, 'operator', 'the operator\'s pin');
  if ((await pinnedBy.getByRole('listitem').allTextContents()).join('|') !== 'operator|acme') problems.push(`pinned by: ${await pinnedBy.textContent()}`);
  await audit('adapters');
  await botAll.getByRole('button', { name: 'Unpin', exact: true }).click();
  await audit('adapters-unpin-confirm');
  await botAll.getByRole('alertdialog').getByRole('button', { name: 'Unpin' }).click();
  await botAll.getByRole('button', { name: 'Pin', exact: true }).waitFor();
  await botAll.getByRole('button', { name: "Release acme's pin" }).click();
  await botAll.getByRole('alertdialog').getByRole('button', { name: 'Release' }).click();
  await expectText(pinnedBy, 'nobody', 'no pins left');
  const residency = await botAll.getByRole('cell').nth(8).textContent();
  if (residency !== 'pool') problems.push(`after the pins are gone, support-bot is ${residency}, not still cached in the pool`);
  console.log(`  adapters: pinned by the operator and acme, both let go; still ${residency}`);

  step('the operator mints a metrics key for a Prometheus server and sees it listed');
  await page.getByRole('link', { name: 'Operator keys' }).click();
  const opForm = page.getByRole('form', { name: 'New key for the operator' });
  await opForm.getByRole('button', { name: 'Create key' }).click();
  const opField = page.getByRole('textbox', { name: 'New key for the operator' });
  await opField.waitFor();
  const opSecret = await opField.inputValue();
  const scrape = await fetch(`${base}/metrics`, { headers: { Authorization: `Bearer ${opSecret}` } });
  if (scrape.status !== 200) problems.push(`the minted metrics key reads /metrics with ${scrape.status}`);
  await page.getByRole('button', { name: 'Done' }).click();
  const opKeys = page.getByRole('table', { name: 'Keys of the operator' });
  await expectText(opKeys.getByRole('row').filter({ hasText: opSecret.slice(0, 12) }), 'metrics', 'the metrics key listed');
  await audit('operator-keys');

  step('the operator creates a plan, edits its prices, gives acme its own price, and reads the audit log');
  await page.getByRole('link', { name: 'Plans and prices' }).click();
  const newPlan = page.getByRole('form', { name: 'New plan' });
  await newPlan.getByLabel('Name').fill('startup');
  await newPlan.getByLabel('Prompt ($ per M tokens)', { exact: true }).fill('0.3');
  await newPlan.getByLabel('Cached prompt ($ per M tokens)', { exact: true }).fill('0.075');
  await newPlan.getByLabel('Completion ($ per M tokens)', { exact: true }).fill('0.9');
  await newPlan.getByRole('button', { name: 'Create plan' }).click();
  const plansTable = page.getByRole('table', { name: 'Plans' });
  const startup = plansTable.getByRole('row').filter({ has: page.getByRole('rowheader', { name: 'startup', exact: true }) });
  await expectText(startup, '$0.90', 'the new plan listed');
  await startup.getByRole('button', { name: 'Edit prices' }).click();
  const editPlan = page.getByRole('form', { name: 'Prices of startup' });
  await editPlan.getByLabel('Completion ($ per M tokens)', { exact: true }).fill('1.1');
  await audit('plan-edit');
  await editPlan.getByRole('button', { name: 'Save prices' }).click();
  await expectText(startup, '$1.10', 'the edited price');
  const stored = (await (await fetch(`${base}/admin/plans`, { headers: { Authorization: `Bearer ${adminKey}` } })).json()).data.find((/** @type {any} */ p) => p.name === 'startup');
  if (!stored || stored.completion_price !== 1100000 || stored.prompt_price !== 300000) problems.push(`the stored plan: ${JSON.stringify(stored)}`);
  const own = page.getByRole('region', { name: "A tenant's own prices" });
  await own.getByLabel('Tenant').selectOption({ label: 'acme' });
  const ownPrices = own.getByRole('form', { name: 'Own prices' });
  await ownPrices.getByLabel('Completion ($ per M tokens)', { exact: true }).fill('1.2');
  await ownPrices.getByRole('button', { name: 'Save own prices' }).click();
  await expectText(own.getByRole('status'), 'Completion $1.20', "acme's own price");
  await audit('tenant-prices');
  const acmeMe = await (await fetch(`${base}/v1/me`, { headers: { Authorization: `Bearer ${tenantKey}` } })).json();
  if (acmeMe.prices.completion_price !== 1200000 || acmeMe.prices.prompt_price !== 500000) problems.push(`acme pays ${JSON.stringify(acmeMe.prices)}`);
  await own.getByRole('button', { name: "Use the plan's prices" }).click();
  await expectText(own.getByRole('status'), 'Completion $1.50', "acme back on its plan's prices");
  await page.getByRole('link', { name: 'Audit log' }).click();
  const log = page.getByRole('table', { name: 'Audit log' });
  await log.waitFor();
  const logRows = await log.locator('tbody tr').evaluateAll((trs) => trs.map((tr) => [...tr.children].map((c) => c.textContent ?? '')));
  for (const [who, action] of [['operator', 'plan.create'], ['operator', 'plan.update'], ['operator', 'tenant.prices'], ['operator', 'tenant.delete'], ['acme', 'key.create'], ['acme', 'key.revoke'], ['acme', 'adapter.upload']]) {
    if (!logRows.some((r) => r[1] === who && r[2] === action)) problems.push(`the audit log has no ${action} by ${who}: ${JSON.stringify(logRows.slice(0, 12))}`);
  }
  await log.page().getByLabel('Tenant').selectOption({ label: 'acme' });
  await page.waitForFunction(() => [...document.querySelectorAll('table[aria-label="Audit log"] tbody tr')].every((tr) => tr.children[1]?.textContent === 'acme' || tr.children[4]?.textContent === 'acme'), null, { timeout: 5000 })
    .catch(() => problems.push('the audit log filtered to acme shows other tenants\' changes'));
  await audit('audit-log');

  step('the dashboard shows the requests, their latency and the workers, refreshed');
  await page.getByRole('link', { name: 'Dashboard' }).click();
  const figures = page.getByRole('definition');
  await expectText(page.locator('dl.figures div').filter({ hasText: 'Requests finished' }), String(usage.totals.requests), 'requests finished');
  const latencyRows = await page.getByRole('table', { name: 'Latency percentiles' }).locator('tbody tr').evaluateAll((trs) => trs.map((tr) => [...tr.children].map((c) => c.textContent)));
  if (latencyRows.length !== 2 || latencyRows.some((r) => r[1] === '–')) problems.push(`latency percentiles: ${JSON.stringify(latencyRows)}`);
  // A second read arrives within the refresh period: the chart gets its first rate.
  await page.waitForFunction(() => [...document.querySelectorAll('dl.figures dd')][2]?.textContent !== '–', null, { timeout: 10_000 })
    .catch(() => problems.push('the dashboard did not refresh'));
  console.log(`  dashboard: ${JSON.stringify(await figures.allTextContents())}, latency ${JSON.stringify(latencyRows)}`);
  await audit('dashboard');

  const violations = await page.evaluate(() => /** @type {any} */ (window).__violations);
  for (const v of violations) problems.push(`content security policy violation: ${v}`);
} catch (e) {
  problems.push(`failed after "${steps.at(-1)}": ${e instanceof Error ? e.stack : e}`);
  await page.screenshot({ path: `${out}/failure.png`, fullPage: true }).catch(() => {});
} finally {
  await browser.close();
}

if (problems.length) {
  console.log(`console e2e: ${problems.length} problem(s)`);
  for (const p of problems) console.log(`  ${p}`);
  process.exit(1);
}
console.log(`console e2e: ok (${steps.length} steps)`);
