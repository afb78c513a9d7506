// The live view: the memory pool from /admin/pool and rates from /metrics, every few seconds.
import { call } from "./api.js";
import { drawLines } from "./chart.js";
import { bytes, element } from "./format.js";

const $ = (id) => document.getElementById(id);
const HISTORY = 60;
const history = { tokensPerSecond: [], ttftMs: [], itlMs: [] };
let previous = null;

function parseMetrics(text) {
  const totals = { tokens: 0, ttftSum: 0, ttftCount: 0, itlSum: 0, itlCount: 0 };
  const field = {
    loraserve_generation_tokens_total: "tokens",
    loraserve_time_to_first_token_seconds_sum: "ttftSum",
    loraserve_time_to_first_token_seconds_count: "ttftCount",
    loraserve_inter_token_latency_seconds_sum: "itlSum",
    loraserve_inter_token_latency_seconds_count: "itlCount",
  };
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const [series, value] = line.split(/ (?=[^ ]+$)/);
    const name = field[series.split("{")[0]]; // summed over labels: adapters, and a cluster's replicas
    if (name) totals[name] += Number(value);
  }
  return { ...totals, time: performance.now() / 1000 };
}

function push(list, value) {
  list.push(value);
  if (list.length > HISTORY) list.shift();
}

function meanOver(now, before, sum, count) {
  const n = now[count] - before[count];
  return n > 0 ? (1000 * (now[sum] - before[sum])) / n : 0;
}

// A cluster's /admin/pool lists its replicas (`loraserve cluster`): the meters show their sums, the list each one.
function wholePool(answer) {
  const replicas = answer.replicas;
  if (!replicas) return answer;
  const sum = (value) => replicas.reduce((total, replica) => total + value(replica), 0);
  const sums = (part, keys) => Object.fromEntries(keys.map((key) => [key, sum((r) => r[part][key])]));
  const first = replicas[0] ?? { pages: { block_size: 0, page_bytes: 0 } };
  return {
    pages: { ...sums("pages", ["total", "kv", "adapters", "free"]),
      block_size: first.pages.block_size, page_bytes: first.pages.page_bytes },
    prefix_cache: sums("prefix_cache", ["queried_tokens", "hit_tokens", "blocks"]),
    speculation: sums("speculation", ["draft_tokens", "accepted_tokens", "bonus_tokens"]),
    adapter_slots: sums("adapter_slots", ["total", "used"]),
    host_cache: sums("host_cache", ["bytes", "capacity_bytes"]),
    ...Object.fromEntries(["running_sequences", "waiting_sequences", "adapter_loads", "adapter_evictions",
      "adapter_disk_reads"].map((key) => [key, sum((r) => r[key])])),
    host_adapters: replicas.flatMap((r) => r.host_adapters.map((name) => `${name} (${r.replica})`)),
    device_adapters: replicas.flatMap((r) => r.device_adapters.map((a) => ({ ...a, name: `${a.name} on ${r.replica}` }))),
  };
}

function showReplicas(replicas) {
  $("replicas").hidden = !replicas;
  $("replica-list").replaceChildren(...(replicas ?? []).map((r) => element("li", {},
    `${r.replica} (node ${r.node.slice(0, 8)}): ${r.adapter_slots.used} of ${r.adapter_slots.total} slots, ` +
    `${r.running_sequences} running, ${r.waiting_sequences} waiting; ` +
    `${r.device_adapters.map((a) => a.name).join(", ") || "no adapter"} on the device`)));
}

export async function refreshLive() {
  const [answer, metricsText] = await Promise.all([call("GET", "/admin/pool"), call("GET", "/metrics")]);
  showReplicas(answer.replicas);
  const pool = wholePool(answer);
  const pages = pool.pages;
  $("kv-meter").max = pages.total;
  $("kv-meter").value = pages.kv;
  $("adapter-page-meter").max = pages.total;
  $("adapter-page-meter").value = pages.adapters;
  $("kv-text").textContent = `${pages.kv} pages hold KV blocks (${pages.block_size} tokens each), ` +
    `${pages.adapters} hold adapter weights, ${pages.free} free; ${pages.total} pages of ${bytes(pages.page_bytes)}`;
  const cache = pool.prefix_cache;
  const found = cache.queried_tokens ? Math.round((100 * cache.hit_tokens) / cache.queried_tokens) : 0;
  $("prefix-text").textContent = `Prefix cache: ${cache.hit_tokens} of ${cache.queried_tokens} prompt tokens ` +
    `found instead of computed (${found}%); ${cache.blocks} blocks findable`;
  const drafts = pool.speculation;
  const kept = drafts.draft_tokens ? Math.round((100 * drafts.accepted_tokens) / drafts.draft_tokens) : 0;
  $("speculation-text").textContent = drafts.draft_tokens
    ? `Speculative decoding: ${drafts.accepted_tokens} of ${drafts.draft_tokens} draft tokens kept (${kept}%), ` +
      `${drafts.bonus_tokens} bonus tokens`
    : "Speculative decoding: no drafts verified (off, or none proposed yet)";
  $("slot-meter").max = pool.adapter_slots.total;
  $("slot-meter").value = pool.adapter_slots.used;
  $("slot-text").textContent = `${pool.adapter_slots.used} of ${pool.adapter_slots.total} slots used`;
  $("pool-text").textContent = `${pool.running_sequences} running, ${pool.waiting_sequences} waiting; ` +
    `${pool.adapter_loads} adapter loads, ${pool.adapter_evictions} evictions, ${pool.adapter_disk_reads} disk reads; ` +
    `host cache ${bytes(pool.host_cache.bytes)} of ${bytes(pool.host_cache.capacity_bytes)}: ` +
    `${pool.host_adapters.join(", ") || "nothing else"}`;
  $("resident-list").replaceChildren(...pool.device_adapters.map((a) =>
    element("li", {}, `${a.name} — slot ${a.slot}, rank ${a.rank}, ${a.pages} pages${a.pinned ? ", pinned" : ""}`)));
  const now = parseMetrics(metricsText);
  if (previous) {
    const seconds = Math.max(1e-3, now.time - previous.time);
    push(history.tokensPerSecond, (now.tokens - previous.tokens) / seconds);
    push(history.ttftMs, meanOver(now, previous, "ttftSum", "ttftCount"));
    push(history.itlMs, meanOver(now, previous, "itlSum", "itlCount"));
  }
  previous = now;
  drawLines($("throughput-chart"), [history.tokensPerSecond], ["tokens/s"]);
  drawLines($("latency-chart"), [history.ttftMs, history.itlMs], ["TTFT ms", "inter-token ms"]);
}
