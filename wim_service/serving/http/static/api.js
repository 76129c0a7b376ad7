// Calls to the wim_service HTTP API, with the API key of this tab as a Bearer header.

const KEY_STORAGE = "wim.apiKey";

export function apiKey() {
  return sessionStorage.getItem(KEY_STORAGE) || "";
}

export function setApiKey(key) {
  if (key) sessionStorage.setItem(KEY_STORAGE, key);
  else sessionStorage.removeItem(KEY_STORAGE);
}

function headers(extra = {}) {
  const all = { ...extra };
  const key = apiKey();
  if (key) all.Authorization = `Bearer ${key}`;
  return all;
}

export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

async function failure(response) {
  let body = {};
  try {
    body = await response.json();
  } catch {
    // not JSON: the status says enough
  }
  const detail = body.error || body;
  return new ApiError(
    response.status,
    detail.code || "http_error",
    detail.message || response.statusText || `HTTP ${response.status}`,
  );
}

async function send(method, path, { json, body, type, signal } = {}) {
  const init = { method, signal, headers: headers(type ? { "Content-Type": type } : {}) };
  if (json !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(json);
  } else if (body !== undefined) {
    init.body = body;
  }
  const response = await fetch(path, init);
  if (!response.ok) throw await failure(response);
  return response;
}

export async function openDocument(text, options) {
  const response = await send("POST", "/documents", { json: { context: text, options } });
  return response.json();
}

export async function closeDocument(documentId) {
  await send("DELETE", `/documents/${encodeURIComponent(documentId)}`);
}

export async function pdfText(file) {
  const response = await send("POST", "/extract/pdf", { body: file, type: "application/pdf" });
  return response.json();
}

// One server-sent event block ("event: x\ndata: {...}") as {type, data}, or null.
export function parseEvent(block) {
  let type = "message";
  const data = [];
  for (const line of block.split(/\r?\n/)) {
    if (line.startsWith("event:")) type = line.slice(6).trim();
    else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
  }
  return data.length ? { type, data: JSON.parse(data.join("\n")) } : null;
}

// POST `body` and yield the answer's server-sent events; aborting `signal` ends the request
// (the server then cancels the job).
export async function* streamEvents(path, body, signal) {
  const response = await send("POST", path, { json: body, signal });
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      let end;
      while ((end = buffer.search(/\r?\n\r?\n/)) >= 0) {
        const event = parseEvent(buffer.slice(0, end));
        buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, "");
        if (event) yield event;
      }
    }
  } finally {
    reader.releaseLock();
  }
}
