// The console's entry: which page this shell is (its <meta>), the sign-in gate, then that page's module.
import { api, signIn, signOut, toLogin, token } from "./api.js";
import { h, page } from "./dom.js";

const name = document.querySelector('meta[name="moetune-page"]').content;
const PAGES = {
  jobs: () => import("./jobs.js"),
  job: () => import("./job.js"),
  report: () => import("./job.js"),
  new: () => import("./new.js"),
  compare: () => import("./compare.js"),
  playground: () => import("./playground.js"),
};

function showLogin() {
  const params = new URLSearchParams(location.search);
  const next = params.get("next");
  const error = h("p", { class: "error", id: "login-error", role: "alert" });
  const input = h("input", { id: "token", name: "token", type: "password", autocomplete: "current-password",
    required: true, "aria-describedby": "login-error" });
  const form = h("form", { class: "card", id: "login-form" },
    h("label", {}, "API token", input),
    h("p", { class: "muted" }, "The same Bearer token the API takes (MOETUNE_API_TOKENS). It is kept for this tab only."),
    error, h("button", { type: "submit", id: "sign-in" }, "Sign in"));
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    signIn(input.value.trim());
    const check = await api("/v1/fine_tuning/jobs?limit=1");
    if (check.ok) {
      location.assign(next && next.startsWith("/console/") ? next : "/console/jobs");
    } else {
      signOut();
      error.textContent = check.status === 401 ? "This token is not valid." : check.error.message;
      input.setAttribute("aria-invalid", "true");
      input.focus();
    }
  });
  page("Sign in", form);
  input.focus();
}

async function start() {
  for (const link of document.querySelectorAll("[data-nav]")) {
    if (link.dataset.nav === name || (name === "job" && link.dataset.nav === "jobs")) link.setAttribute("aria-current", "page");
  }
  if (name === "login") return showLogin();
  if (!token()) return toLogin();
  const out = document.getElementById("sign-out");
  out.hidden = false;
  out.addEventListener("click", () => { signOut(); location.assign("/console/login"); });
  const module = await PAGES[name]();
  await module.render(name);
}

start();
