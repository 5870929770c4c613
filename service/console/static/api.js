// The API as the page calls it: the signed-in token (sessionStorage) as the Bearer token of every request.
const KEY = "moetune.token";

export const token = () => sessionStorage.getItem(KEY);
export const signIn = (value) => sessionStorage.setItem(KEY, value);
export const signOut = () => sessionStorage.removeItem(KEY);

export function toLogin() {
  const next = location.pathname + location.search;
  location.assign(`/console/login?next=${encodeURIComponent(next)}`);
}

// {ok, status, data, error}: error is the API's {code, message, param} on a 4xx/5xx.
export async function api(path, { method = "GET", json, body, signal, raw = false } = {}) {
  const headers = { Authorization: `Bearer ${token()}` };
  if (json !== undefined) {
    headers["Content-Type"] = "application/json";
    body = JSON.stringify(json);
  }
  const response = await fetch(path, { method, headers, body, signal });
  return answer(response.status, await response.text(), raw);
}

function answer(status, text, raw = false) {
  const ok = status >= 200 && status < 300;
  let data = text;
  if (!raw || !ok) { // error bodies are JSON whatever the route answers on success
    try { data = text ? JSON.parse(text) : null; } catch { data = text; }
  }
  if (status === 401 && location.pathname !== "/console/login") toLogin();
  const error = ok ? null : (data && data.error) || { code: "http_error", message: `HTTP ${status}` };
  return { ok, status, data, error };
}

// A multipart POST that reports its progress (fetch reports none on uploads): onProgress(sentBytes, totalBytes).
// Answers as api() does.
export function upload(path, form, onProgress) {
  return new Promise((resolve) => {
    const request = new XMLHttpRequest();
    request.open("POST", path);
    request.setRequestHeader("Authorization", `Bearer ${token()}`);
    request.upload.addEventListener("progress", (e) => { if (e.lengthComputable) onProgress(e.loaded, e.total); });
    request.addEventListener("load", () => resolve(answer(request.status, request.responseText)));
    request.addEventListener("error", () => resolve({ ok: false, status: 0, data: null,
      error: { code: "network_error", message: "The upload was cut off before the server answered." } }));
    request.send(form);
  });
}

// Server-Sent Events read from a fetch body (EventSource cannot send an Authorization header):
// yields {event, id, data} frames until the server ends the stream.
export async function* eventStream(path, { method = "GET", json, signal } = {}) {
  const headers = { Authorization: `Bearer ${token()}`, Accept: "text/event-stream" };
  let body;
  if (json !== undefined) {
    headers["Content-Type"] = "application/json";
    body = JSON.stringify(json);
  }
  const response = await fetch(path, { method, headers, body, signal });
  if (!response.ok) {
    let error;
    try { error = (await response.json()).error; } catch { error = null; }
    throw Object.assign(new Error(error?.message || `HTTP ${response.status}`), { status: response.status, error });
  }
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replace(/\r\n/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const frame = { event: "message", id: null, data: "" };
      for (const line of buffer.slice(0, end).split("\n")) {
        const [field, ...rest] = line.split(":");
        const text = rest.join(":").replace(/^ /, "");
        if (field === "event") frame.event = text;
        else if (field === "id") frame.id = text;
        else if (field === "data") frame.data += (frame.data ? "\n" : "") + text;
      }
      buffer = buffer.slice(end + 2);
      if (frame.data || frame.event !== "message") yield frame;
    }
  }
}

export const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);
export const STATUSES = ["validating_files", "queued", "running", "pausing", "paused", "succeeded", "failed",
  "cancelled"];

// Every page of a list route (newest first), up to `most` items.
export async function allPages(path, most = 1000) {
  const items = [];
  let after = null;
  while (items.length < most) {
    const sep = path.includes("?") ? "&" : "?";
    const page = await api(`${path}${sep}limit=100${after ? `&after=${encodeURIComponent(after)}` : ""}`);
    if (!page.ok) return { ...page, items };
    items.push(...page.data.data);
    if (!page.data.has_more || !page.data.last_id) break;
    after = page.data.last_id;
  }
  return { ok: true, items };
}

// job => the name of its base: a job's `model` is the URI it was resolved to; the registered bases' names come from
// GET /v1/models/{name} (the list leaves their URIs out), else the URI's last folder (as the API derives names).
export async function baseNames() {
  const listed = await api("/v1/models");
  const bases = listed.ok ? listed.data.data.filter((m) => m.owned_by === "moetune") : [];
  const found = await Promise.all(bases.map((m) => api(`/v1/models/${encodeURIComponent(m.id)}`)));
  const byUri = new Map(found.filter((a) => a.ok && a.data.moetune?.base_model_uri)
    .map((a) => [a.data.moetune.base_model_uri.replace(/\/+$/, ""), a.data.id]));
  return (job) => {
    const uri = job.model.replace(/\/+$/, "");
    if (!/^[a-z][a-z0-9+.-]*:\/\//.test(uri)) return job.model;
    return byUri.get(uri) || uri.split("://").pop().split("/").pop();
  };
}
