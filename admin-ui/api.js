// @ts-check
/**
 * The public REST API, called with the key the user signed in with. The key lives in session
 * storage (gone when the tab closes) and only ever travels in the Authorization header.
 */

const KEY = 'loraplex.key';

/** An error answer of the API (or no answer at all: status 0), with the server's message. */
export class ApiError extends Error {
  /**
   * @param {number} status
   * @param {string} message
   * @param {string} [code]
   */
  constructor(status, message, code) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

/** @returns {string | null} */
export function savedKey() {
  return sessionStorage.getItem(KEY);
}

/** @param {string} key */
export function saveKey(key) {
  sessionStorage.setItem(KEY, key);
}

export function forgetKey() {
  sessionStorage.removeItem(KEY);
}

/**
 * Calls the API; resolves to the parsed JSON answer (null for 204), rejects with an ApiError.
 * @param {string} method
 * @param {string} path
 * @param {unknown} [body] sent as JSON
 * @returns {Promise<any>}
 */
export async function api(method, path, body) {
  /** @type {Record<string, string>} */
  const headers = { Accept: 'application/json' };
  const key = savedKey();
  if (key) headers.Authorization = `Bearer ${key}`;
  if (body !== undefined) headers['Content-Type'] = 'application/json';
  let res;
  try {
    res = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  } catch (e) {
    throw new ApiError(0, `The server cannot be reached: ${e instanceof Error ? e.message : String(e)}`);
  }
  if (res.status === 204) return null;
  const text = await res.text();
  /** @type {any} */
  let data = text;
  try {
    data = text ? JSON.parse(text) : null;
  } catch {
    // Not JSON: kept as text for the error message below.
  }
  if (!res.ok) {
    const message = data && typeof data === 'object' && data.error ? String(data.error.message) : text || res.statusText;
    const code = data && typeof data === 'object' && data.error ? String(data.error.code) : undefined;
    throw new ApiError(res.status, message, code);
  }
  return data;
}

/**
 * Posts `body` with `stream: true` and calls `onEvent` with each server-sent event's parsed
 * data until `[DONE]`; an error event or an error answer rejects with an ApiError.
 * @param {string} path
 * @param {object} body
 * @param {(event: any) => void} onEvent
 * @param {AbortSignal} [signal]
 */
export async function stream(path, body, onEvent, signal) {
  const key = savedKey();
  /** @type {Record<string, string>} */
  const headers = { 'Content-Type': 'application/json', Accept: 'text/event-stream' };
  if (key) headers.Authorization = `Bearer ${key}`;
  const res = await fetch(path, { method: 'POST', headers, body: JSON.stringify({ ...body, stream: true }), signal }).catch((e) => {
    throw new ApiError(0, `The server cannot be reached: ${e instanceof Error ? e.message : String(e)}`);
  });
  if (!res.ok || !res.body) {
    const text = await res.text();
    let message = text;
    try {
      message = JSON.parse(text).error.message;
    } catch {
      // The text as it came.
    }
    throw new ApiError(res.status, message);
  }
  const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = '';
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let cut;
    while ((cut = buffer.indexOf('\n\n')) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = block
        .split('\n')
        .filter((l) => l.startsWith('data:'))
        .map((l) => l.slice(5).trimStart())
        .join('\n');
      if (!data) continue;
      if (data === '[DONE]') return;
      const event = JSON.parse(data);
      if (event.error) throw new ApiError(500, String(event.error.message), event.error.code);
      onEvent(event);
    }
  }
}

/**
 * Posts a multipart form with upload progress (`fetch` cannot report it): `onProgress` gets the
 * fraction sent. Resolves to the parsed JSON answer, rejects with an ApiError.
 * @param {string} path
 * @param {FormData} form
 * @param {(fraction: number) => void} onProgress
 * @returns {Promise<any>}
 */
export function upload(path, form, onProgress) {
  return new Promise((resolve, reject) => {
    const xhr = new XMLHttpRequest();
    xhr.open('POST', path);
    const key = savedKey();
    if (key) xhr.setRequestHeader('Authorization', `Bearer ${key}`);
    xhr.upload.onprogress = (e) => e.lengthComputable && onProgress(e.loaded / e.total);
    xhr.onerror = () => reject(new ApiError(0, 'The server cannot be reached (the upload failed).'));
    xhr.onload = () => {
      /** @type {any} */
      let data = xhr.responseText;
      try {
        data = JSON.parse(xhr.responseText);
      } catch {
        // Kept as text.
      }
      if (xhr.status >= 200 && xhr.status < 300) {
        onProgress(1);
        resolve(data);
      } else {
        const message = data && typeof data === 'object' && data.error ? String(data.error.message) : String(data || xhr.statusText);
        reject(new ApiError(xhr.status, message, data?.error?.code));
      }
    };
    xhr.send(form);
  });
}

/**
 * Downloads `path` (a GET with the key) as a file named `name`; resolves to its text.
 * @param {string} path
 * @param {string} name
 * @returns {Promise<string>}
 */
export async function download(path, name) {
  const key = savedKey();
  const res = await fetch(path, { headers: key ? { Authorization: `Bearer ${key}` } : {} }).catch((e) => {
    throw new ApiError(0, `The server cannot be reached: ${e instanceof Error ? e.message : String(e)}`);
  });
  const text = await res.text();
  if (!res.ok) {
    let message = text;
    try {
      message = JSON.parse(text).error.message;
    } catch {
      // Not the API's JSON error: the text as it came.
    }
    throw new ApiError(res.status, message);
  }
  const url = URL.createObjectURL(new Blob([text], { type: res.headers.get('content-type') ?? 'text/plain' }));
  const a = document.createElement('a');
  a.href = url;
  a.download = name;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10_000);
  return text;
}

/**
 * Which console a key opens: `operator` for a key with the admin scope, `tenant` for a key
 * with the inference scope (the operator routes answer it 403). Rejects with the API's error
 * for an unknown or revoked key, and with a 403 of its own for a key with neither scope (an
 * operator's metrics key, a tenant key for adapters only).
 * @returns {Promise<'operator' | 'tenant'>}
 */
export async function role() {
  try {
    await api('GET', '/admin/tenants');
    return 'operator';
  } catch (e) {
    if (!(e instanceof ApiError && e.status === 403)) throw e;
  }
  try {
    await api('GET', '/v1/models');
    return 'tenant';
  } catch (e) {
    if (e instanceof ApiError && e.status === 403) {
      throw new ApiError(403, 'This key has neither the admin nor the inference scope: the console needs one of them.');
    }
    throw e;
  }
}
