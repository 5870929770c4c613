// Chat with a tuned model and its base side by side, streamed from the OpenAI-compatible Serve app through the
// console's same-origin pass-through (/console/serve/chat/completions).
import { api, eventStream } from "./api.js";
import { h, page, replace } from "./dom.js";

const baseOf = (name) => (name.startsWith("ft:") ? name.split(":")[1] : null);

export async function render() {
  const params = new URLSearchParams(location.search);
  const models = await api("/v1/models");
  const names = models.ok ? models.data.data.map((m) => m.id) : [];
  const tuned = names.filter((n) => n.startsWith("ft:"));
  const pick = h("select", { id: "model", name: "model" }, names.map((n) => h("option", { value: n }, n)));
  pick.value = params.get("model") && names.includes(params.get("model")) ? params.get("model") : tuned[0] || names[0] || "";
  const withBase = h("input", { type: "checkbox", id: "with-base", checked: true });
  const system = h("input", { type: "text", id: "system", size: 40, placeholder: "optional system message" });
  const message = h("textarea", { id: "message", rows: 3, required: true, placeholder: "Ask something…" });
  const maxTokens = h("input", { type: "number", id: "max-tokens", value: 24, min: 1, max: 4096 });
  const temperature = h("input", { type: "number", id: "temperature", value: 0, min: 0, max: 2, step: 0.1 });
  const send = h("button", { type: "submit", id: "send" }, "Send");
  const columns = h("div", { class: "chat", id: "answers" });
  const conversations = new Map(); // model -> messages so far

  if (!names.length) {
    return page("Playground", h("p", { class: "notice", id: "no-models" },
      "No model to chat with: a succeeded job's tuned model, or a base registered in MOETUNE_BASE_MODELS, appears here. ",
      "Deploy a succeeded job from its page first (the Serve app answers the chat)."));
  }

  async function ask(model, box) {
    const messages = conversations.get(model) || [];
    if (!messages.length && system.value.trim()) messages.push({ role: "system", content: system.value.trim() });
    messages.push({ role: "user", content: message.value });
    conversations.set(model, messages);
    const transcript = box.querySelector(".transcript");
    transcript.append(h("div", { class: "user" }, `you: ${message.value}`));
    const answer = h("div", { class: "assistant", "data-model": model });
    transcript.append(answer);
    let text = "";
    try {
      const body = { model, messages, stream: true, max_tokens: Number(maxTokens.value), temperature: Number(temperature.value) };
      for await (const frame of eventStream("/console/serve/chat/completions", { method: "POST", json: body })) {
        if (frame.data === "[DONE]") break;
        const chunk = JSON.parse(frame.data);
        if (chunk.error) throw new Error(chunk.error.message);
        text += chunk.choices?.[0]?.delta?.content || "";
        answer.textContent = text;
      }
      answer.dataset.done = "true";
      messages.push({ role: "assistant", content: text });
    } catch (error) {
      answer.className = "error";
      answer.textContent = error.message;
      answer.dataset.done = "error";
      messages.pop();
    }
  }

  const layout = () => {
    const chosen = [pick.value];
    const base = baseOf(pick.value);
    if (withBase.checked && base && names.includes(base)) chosen.push(base);
    replace(columns, chosen.map((model) => h("section", { class: "card", "data-model": model, "aria-label": `answers of ${model}` },
      h("h2", { class: "mono" }, model), h("div", { class: "transcript", "aria-live": "polite" }))));
    conversations.clear();
  };
  pick.addEventListener("change", layout);
  withBase.addEventListener("change", layout);

  const form = h("form", { class: "card", id: "chat-form" },
    h("div", { class: "row" }, h("label", { for: "model" }, "Model", pick),
      h("label", { for: "with-base", style: "flex-direction: row; align-items: center; gap: 6px" }, withBase, "beside its base"),
      h("label", { for: "max-tokens" }, "Max tokens", maxTokens), h("label", { for: "temperature" }, "Temperature", temperature)),
    h("label", { for: "system" }, "System", system),
    h("label", { for: "message" }, "Message", message), send);
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    if (!message.value.trim()) return message.focus();
    send.disabled = true;
    await Promise.all([...columns.children].map((box) => ask(box.dataset.model, box)));
    message.value = "";
    send.disabled = false;
    message.focus();
  });
  message.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) form.requestSubmit();
  });
  page("Playground", form, columns,
    h("p", { class: "muted" }, "Answers stream from the Serve app (POST /v1/chat/completions) with your token; ",
      "a model answers once its job is deployed. Ctrl+Enter sends."));
  layout();
}
