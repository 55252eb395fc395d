// @ts-check
/** The console's shell: sign-in, the navigation of the signed-in role, and the current view. */
import { html, render, useEffect, useState } from './vendor/preact-htm.js';
import { ApiError, forgetKey, role, saveKey, savedKey } from './api.js';
import { ErrorNote } from './views/common.js';
import { Tenants } from './views/tenants.js';
import { MyAdapters } from './views/adapters.js';
import { Billing } from './views/billing.js';
import { OperatorKeys } from './views/keys.js';
import { Dashboard } from './views/dashboard.js';
import { AllAdapters } from './views/all-adapters.js';
import { Usage } from './views/usage.js';
import { Playground } from './views/playground.js';
import { Account, AuditLog, Plans } from './views/business.js';

/** @typedef {'operator' | 'tenant'} Role */

/** The views of each role: [hash, title, component]. */
const VIEWS = {
  operator: [
    ['dashboard', 'Dashboard', Dashboard],
    ['tenants', 'Tenants', Tenants],
    ['adapters', 'Adapters', AllAdapters],
    ['billing', 'Billing', Billing],
    ['plans', 'Plans and prices', Plans],
    ['audit', 'Audit log', AuditLog],
    ['keys', 'Operator keys', OperatorKeys],
  ],
  tenant: [
    ['adapters', 'My adapters', MyAdapters],
    ['playground', 'Playground', Playground],
    ['usage', 'Usage', Usage],
    ['account', 'Account and keys', Account],
  ],
};

/** @param {{ onSignedIn: (r: Role) => void }} props */
function SignIn({ onSignedIn }) {
  const [key, setKey] = useState('');
  const [error, setError] = useState(/** @type {unknown} */ (null));
  const [busy, setBusy] = useState(false);
  /** @param {Event} e */
  const submit = async (e) => {
    e.preventDefault();
    setBusy(true);
    setError(null);
    saveKey(key.trim());
    try {
      onSignedIn(await role());
    } catch (err) {
      forgetKey();
      setError(err);
    } finally {
      setBusy(false);
    }
  };
  return html`<main class="signin">
    <h1>loraplex console</h1>
    <form onSubmit=${submit} aria-describedby="signin-help">
      <label for="key">API key</label>
      <input id="key" type="password" autocomplete="off" required value=${key}
        onInput=${(/** @type {any} */ e) => setKey(e.currentTarget.value)} />
      <p id="signin-help" class="help">An operator key (admin scope) or a tenant's key. It is kept in this tab only.</p>
      <button type="submit" disabled=${busy}>${busy ? 'Signing in…' : 'Sign in'}</button>
      <${ErrorNote} error=${error} />
    </form>
  </main>`;
}

/** @returns {string} */
function currentHash() {
  return location.hash.replace(/^#\/?/, '');
}

function App() {
  const [who, setWho] = useState(/** @type {Role | null | 'checking'} */ (savedKey() ? 'checking' : null));
  const [hash, setHash] = useState(currentHash());
  const [error, setError] = useState(/** @type {unknown} */ (null));
  useEffect(() => {
    const onHash = () => setHash(currentHash());
    addEventListener('hashchange', onHash);
    return () => removeEventListener('hashchange', onHash);
  }, []);
  useEffect(() => {
    if (who !== 'checking') return;
    role().then(setWho, (e) => {
      if (e instanceof ApiError && e.status === 401) forgetKey();
      setError(e);
      setWho(null);
    });
  }, [who]);
  if (who === 'checking') return html`<p class="loading">Checking the key…</p>`;
  if (who === null) {
    return html`<div>
      <${ErrorNote} error=${error} />
      <${SignIn} onSignedIn=${(/** @type {Role} */ r) => { setError(null); setWho(r); }} />
    </div>`;
  }
  const views = VIEWS[who];
  const view = views.find(([h]) => h === hash) ?? views[0];
  const [, title, View] = view;
  const signOut = () => {
    forgetKey();
    setWho(null);
  };
  return html`<div class="shell">
    <header>
      <span class="brand">loraplex</span>
      <nav aria-label="Views">
        ${views.map(([h, t]) => html`<a href=${'#/' + h} aria-current=${h === view[0] ? 'page' : undefined}>${t}</a>`)}
      </nav>
      <span class="who">${who === 'operator' ? 'Operator' : 'Tenant'}</span>
      <button type="button" class="link" onClick=${signOut}>Sign out</button>
    </header>
    <main>
      <h1>${title}</h1>
      <${View} />
    </main>
  </div>`;
}

const root = document.getElementById('app');
if (root) {
  root.textContent = '';
  render(html`<${App} />`, root);
}
