// One confirmation dialog for every destructive action: `action` runs only when confirmed.
const $ = (id) => document.getElementById(id);

export function confirmThen(text, buttonText, action) {
  const dialog = $("confirm-dialog");
  $("confirm-text").textContent = text;
  $("confirm-button").textContent = buttonText;
  dialog.onclose = () => dialog.returnValue === "confirm" && action();
  dialog.showModal();
}
