// Sign-in page: exchange an API key for a session cookie (POST /v1/auth/session), then go on.
import { api } from "./api.js";

const form = document.getElementById("signin");
const input = document.getElementById("api-key");
const errorEl = document.getElementById("signin-error");

function nextUrl() {
  const next = new URLSearchParams(location.search).get("next") || "/";
  // Only same-site paths: never bounce to another origin.
  return next.startsWith("/") && !next.startsWith("//") ? next : "/";
}

form.addEventListener("submit", async (ev) => {
  ev.preventDefault();
  errorEl.textContent = "";
  const key = input.value.trim();
  if (!key) {
    errorEl.textContent = "Enter an API key.";
    input.focus();
    return;
  }
  try {
    await api("/v1/auth/session", { method: "POST", body: { api_key: key }, redirect401: false });
    location.assign(nextUrl());
  } catch (e) {
    errorEl.textContent = e.status === 401 || e.status === 403 ? "This key is not valid (or was revoked)." : e.message;
    input.setAttribute("aria-invalid", "true");
  }
});
input.focus();
