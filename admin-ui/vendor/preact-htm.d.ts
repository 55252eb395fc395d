// Types of preact-htm.js (htm's `preact/standalone` bundle): htm's own declarations.
export * from 'htm/preact';
