// Pagoda's live dashboard: reads /dashboard/events (SSE) and draws each replica's KV block map on a canvas,
// its queues, and the time series. No library, no build step. DOM nodes are reused or replaced, never piled up.
"use strict";
(function () {
  // Block states as the frames number them; "reserved" is the null block and "other" a block of another KV
  // cache group (only in a group's map).
  const STATES = ["free", "cached", "owned", "shared", "swapped", "reserved", "other"];
  const COUNTED = 5; // the states of the legend line and of decodedCounts
  const css = getComputedStyle(document.documentElement);
  const COLORS = STATES.map((s) => css.getPropertyValue("--" + s).trim());
  const MAX_ROWS = 12; // queue rows shown per queue; the rest is counted
  const MAX_POINTS = 300; // time-series points kept (five minutes at one a second)
  const CHARTS = [
    ["Output tokens/s", [["output_tps", 1, "#3182bd"]], ""],
    ["Running / waiting", [["running", 1, "#3182bd"], ["waiting", 1, "#e6550d"]], ""],
    ["KV usage", [["kv_usage", 100, "#3182bd"]], "%"],
    ["Prefix-cache hit rate", [["prefix_hit_rate", 100, "#31a354"]], "%"],
    ["Preemptions per second", [["preemptions", 1, "#e6550d"]], ""],
    ["TTFT p50 / p99", [["ttft_p50", 1000, "#3182bd"], ["ttft_p99", 1000, "#e6550d"]], " ms"],
    ["ITL p50 / p99", [["itl_p50", 1000, "#3182bd"], ["itl_p99", 1000, "#e6550d"]], " ms"],
    // KV tiers (host, disk): shown once a point carries them
    ["KV tier usage host / disk", [["host_tier_usage", 100, "#756bb1"], ["disk_tier_usage", 100, "#636363"]], "%"],
    ["KV tier hits/s host / disk", [["host_tier_hits", 1, "#756bb1"], ["disk_tier_hits", 1, "#636363"]], ""],
    ["Step budget / chunk (tokens)", [["token_budget", 1, "#3182bd"], ["chunk_size", 1, "#e6550d"]], ""],
    ["SLO attainment TTFT / TPOT", [["ttft_attainment", 100, "#3182bd"], ["tpot_attainment", 100, "#e6550d"]], "%"],
  ];
  const views = new Map(); // replica index -> its DOM and decoded arrays
  const tierRows = new Map(); // tier name -> its row's DOM
  const state = { frames: 0, points: [], last: null };
  window.pagodaDashboard = state; // read by the browser tests

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }

  function decodeRuns(runs, out) {
    // [value, count, ...] into the typed array `out`; returns the filled length.
    let i = 0;
    for (let r = 0; r < runs.length; r += 2) {
      out.fill(runs[r], i, i + runs[r + 1]);
      i += runs[r + 1];
    }
    return i;
  }

  function replicaView(index) {
    let v = views.get(index);
    if (v) return v;
    const root = el("div", "replica");
    const title = el("h2", null, "Replica " + index);
    const map = el("canvas", "map");
    const host = el("canvas", "host");
    const counts = el("div", "counts");
    const queues = el("div");
    root.append(title, map, host, counts, queues);
    document.getElementById("replicas").append(root);
    const groups = el("div", "groups");
    root.insertBefore(groups, host);
    v = { root, title, map, host, counts, queues, groups, states: new Uint8Array(0), refs: new Uint32Array(0),
          hostStates: new Uint8Array(0), frame: null, cell: 8, cols: 1, groupViews: [] };
    map.addEventListener("mousemove", (ev) => hover(v, ev));
    map.addEventListener("mouseleave", () => { document.getElementById("tip").hidden = true; });
    views.set(index, v);
    return v;
  }

  function paint(canvas, states, n, height) {
    // Draws `states` (one cell per block) into `canvas`, cells as large as fit `height` px; returns the grid.
    const width = Math.max(200, canvas.clientWidth || canvas.parentElement.clientWidth - 24);
    const cell = Math.max(2, Math.min(14, Math.floor(Math.sqrt((width * height) / Math.max(1, n)))));
    const cols = Math.max(1, Math.floor(width / cell));
    const rows = Math.ceil(n / cols);
    const dpr = window.devicePixelRatio || 1;
    if (canvas.width !== Math.round(width * dpr) || canvas.height !== Math.round(rows * cell * dpr)) {
      canvas.width = Math.round(width * dpr);
      canvas.height = Math.round(rows * cell * dpr);
      canvas.style.height = rows * cell + "px";
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, width, rows * cell);
    const gap = cell >= 5 ? 1 : 0;
    // One fill per state colour run keeps this fast at tens of thousands of blocks.
    for (let s = 0; s < STATES.length; s++) {
      ctx.fillStyle = COLORS[s];
      for (let i = 0; i < n; i++) {
        if (states[i] === s) ctx.fillRect((i % cols) * cell, Math.floor(i / cols) * cell, cell - gap, cell - gap);
      }
    }
    return { cell, cols, width };
  }

  function groupView(v, g) {
    // The canvas of KV cache group `g` of replica view `v` (created once, reused).
    while (v.groupViews.length <= g) {
      const gv = { index: v.groupViews.length, label: el("div", "group-label"), map: el("canvas", "map"),
                   states: new Uint8Array(0), cell: 8, cols: 1 };
      gv.map.addEventListener("mousemove", (ev) => hover(v, ev, gv));
      gv.map.addEventListener("mouseleave", () => { document.getElementById("tip").hidden = true; });
      v.groups.append(gv.label, gv.map);
      v.groupViews.push(gv);
    }
    return v.groupViews[g];
  }

  function drawGroups(v, r) {
    // One map per KV cache group: a sliding-window group holds only the blocks its window still sees.
    const groups = r.groups || [];
    v.map.hidden = groups.length > 0;
    v.groups.hidden = groups.length === 0;
    while (v.groupViews.length > groups.length) {
      const gv = v.groupViews.pop();
      gv.label.remove(); gv.map.remove();
    }
    const height = Math.max(60, Math.floor(320 / Math.max(1, groups.length)));
    for (const g of groups) {
      const gv = groupView(v, g.group);
      if (gv.states.length !== r.num_blocks) gv.states = new Uint8Array(r.num_blocks);
      decodeRuns(g.map, gv.states);
      const kind = g.sliding_window == null ? "full attention" : "sliding window " + g.sliding_window + " tokens";
      const c = g.counts;
      gv.label.textContent = "KV group " + g.group + " (" + kind + "): " + c.owned + " owned · " + c.shared +
        " shared · " + c.cached + " cached · " + c.other + " in other groups";
      const grid = paint(gv.map, gv.states, r.num_blocks, height);
      gv.cell = grid.cell; gv.cols = grid.cols;
    }
  }

  function drawMap(v, r) {
    const n = r.num_blocks;
    if (v.states.length !== n) { v.states = new Uint8Array(n); v.refs = new Uint32Array(n); }
    decodeRuns(r.map, v.states);
    decodeRuns(r.refs, v.refs);
    drawGroups(v, r);
    const grid = r.groups && r.groups.length ? { cell: v.cell, cols: v.cols, width: Math.max(200, v.root.clientWidth - 24) }
      : paint(v.map, v.states, n, 320);
    const width = grid.width;
    const dpr = window.devicePixelRatio || 1;
    v.cell = grid.cell; v.cols = grid.cols;
    const hn = r.num_host_blocks || 0;
    v.host.hidden = hn === 0;
    if (hn) {
      if (v.hostStates.length !== hn) v.hostStates = new Uint8Array(hn);
      decodeRuns(r.host_map, v.hostStates);
      v.host.width = Math.round(width * dpr); v.host.height = Math.round(10 * dpr);
      const h = v.host.getContext("2d");
      h.setTransform(dpr, 0, 0, dpr, 0, 0);
      const w = width / hn;
      for (let i = 0; i < hn; i++) {
        h.fillStyle = COLORS[v.hostStates[i]];
        h.fillRect(i * w, 0, Math.max(1, w - (w > 3 ? 1 : 0)), 10);
      }
      v.host.title = "host (swap) tier: " + hn + " blocks";
    }
  }

  function owners(r, block, tables) {
    const found = [];
    for (const id in tables) {
      const runs = tables[id];
      for (let k = 0; k < runs.length; k += 2) {
        if (block >= runs[k] && block < runs[k] + runs[k + 1]) { found.push(id); break; }
      }
    }
    return found;
  }

  function hover(v, ev, gv) {
    // `gv`: a KV cache group's map (its own states and tables), else the replica's one map.
    const r = v.frame;
    const tip = document.getElementById("tip");
    if (!r || !r.map) { tip.hidden = true; return; }
    const grid = gv || v;
    const rect = grid.map.getBoundingClientRect();
    const col = Math.floor((ev.clientX - rect.left) / grid.cell);
    const row = Math.floor((ev.clientY - rect.top) / grid.cell);
    const i = row * grid.cols + col;
    if (col >= grid.cols || i < 0 || i >= r.num_blocks) { tip.hidden = true; return; }
    const tables = gv && r.group_tables ? r.group_tables[gv.index] : r.tables;
    const who = owners(r, i, tables);
    const states = gv ? gv.states : v.states;
    let text = "block " + i + ": " + STATES[states[i]] + ", ref count " + v.refs[i];
    if (who.length) text += "\nheld by " + who.slice(0, 8).join(", ") + (who.length > 8 ? " +" + (who.length - 8) : "");
    tip.textContent = text;
    tip.hidden = false;
    tip.style.left = ev.clientX + 14 + "px";
    tip.style.top = ev.clientY + 14 + "px";
  }

  function queueTable(name, rows) {
    const frag = document.createDocumentFragment();
    frag.append(el("h3", null, name + " (" + rows.length + ")"));
    if (!rows.length) return frag;
    const table = el("table", "q");
    for (const [id, computed, total, prompt, chunk, priority] of rows.slice(0, MAX_ROWS)) {
      const tr = el("tr");
      const bar = el("div", "bar");
      const done = el("span");
      done.style.width = (100 * computed) / Math.max(1, total) + "%";
      const step = el("b");
      step.style.left = (100 * Math.max(0, computed - chunk)) / Math.max(1, total) + "%";
      step.style.width = (100 * chunk) / Math.max(1, total) + "%";
      bar.append(done, step);
      const tdBar = el("td"); tdBar.append(bar);
      tr.append(el("td", "id", id), tdBar, el("td", null, computed + " / " + total + " tok"),
                el("td", null, chunk ? "chunk " + chunk : ""), el("td", null, "prio " + priority));
      tr.title = id + ": prompt " + prompt + " tokens, " + (total - prompt) + " generated";
      table.append(tr);
    }
    frag.append(table);
    if (rows.length > MAX_ROWS) frag.append(el("div", "more", "+ " + (rows.length - MAX_ROWS) + " more"));
    return frag;
  }

  function drawReplica(r) {
    const v = replicaView(r.replica);
    v.frame = r;
    const c = r.counts;
    const role = r.role ? " (" + r.role + ")" : ""; // disaggregated serving: prefill or decode core
    v.title.textContent = "Replica " + r.replica + role + " — " + r.num_blocks + " blocks × " + r.block_size + " tokens";
    if (r.map) {
      drawMap(v, r);
      v.counts.textContent = STATES.slice(0, COUNTED).map((s) => s + " " + c[s]).join(" · ") +
        " · usage " + (100 * r.kv_usage).toFixed(1) + "%";
    } else {
      v.counts.textContent = "this KV manager (contiguous) keeps no block map";
    }
    const q = r.queues;
    const frag = document.createDocumentFragment();
    frag.append(queueTable("Running", q.running), queueTable("Waiting", q.waiting), queueTable("Swapped", q.swapped));
    v.queues.replaceChildren(frag);
  }

  const charts = CHARTS.map(([title, lines, unit]) => {
    const box = el("div", "chart");
    const head = el("div", "title");
    const value = el("span", "value");
    head.append(el("span", null, title), value);
    const canvas = el("canvas");
    box.append(head, canvas);
    document.getElementById("series").append(box);
    const tiers = lines[0][0].includes("_tier_");
    box.hidden = tiers; // until a point carries a tier
    return { lines, unit, canvas, value, box, tiers };
  });

  function bytes(n) {
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
    return (i ? n.toFixed(1) : String(n)) + " " + units[i];
  }

  function drawTiers(tiers) {
    // One row per KV tier: occupancy bar, used / capacity, blocks served, bytes in and out (rows reused).
    const panel = document.getElementById("tiers");
    panel.hidden = !tiers.length;
    for (const t of tiers) {
      let row = tierRows.get(t.tier);
      if (!row) {
        row = { root: el("div", "tier"), head: el("div"), bar: el("div", "bar"), fill: el("span"), io: el("div") };
        row.bar.append(row.fill);
        row.root.append(row.head, row.bar, row.io);
        row.root.dataset.tier = t.tier;
        document.getElementById("tier-rows").append(row.root);
        tierRows.set(t.tier, row);
      }
      const usage = t.capacity_bytes ? t.used_bytes / t.capacity_bytes : 0;
      row.head.replaceChildren(el("span", "name", t.tier + " tier"),
        document.createTextNode(" " + bytes(t.used_bytes) + " / " + bytes(t.capacity_bytes) + " (" + (100 * usage).toFixed(1) + "%)"));
      row.fill.style.width = 100 * usage + "%";
      row.io.textContent = t.hits + " blocks served · " + bytes(t.bytes_in) + " in · " + bytes(t.bytes_out) + " out";
    }
  }

  function drawCharts() {
    const pts = state.points;
    const anyTier = pts.some((p) => p.host_tier_usage != null || p.disk_tier_usage != null);
    for (const ch of charts) {
      ch.box.hidden = ch.tiers && !anyTier;
      if (ch.box.hidden) continue;
      const w = Math.max(100, ch.canvas.clientWidth), h = 70;
      const dpr = window.devicePixelRatio || 1;
      if (ch.canvas.width !== Math.round(w * dpr)) { ch.canvas.width = Math.round(w * dpr); ch.canvas.height = Math.round(h * dpr); }
      const ctx = ch.canvas.getContext("2d");
      ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
      ctx.clearRect(0, 0, w, h);
      const span = Math.max(60, pts.length); // the x axis fills over the first minute, then scrolls
      let max = 0;
      for (const p of pts) for (const [key, scale] of ch.lines) if (p[key] != null) max = Math.max(max, p[key] * scale);
      max = max > 0 ? max * 1.1 : 1;
      ctx.fillStyle = "#5f6368"; ctx.font = "10px system-ui";
      ctx.fillText(fmt(max) + ch.unit, 2, 10);
      for (const [key, scale, color] of ch.lines) {
        ctx.strokeStyle = color; ctx.lineWidth = 1.5; ctx.beginPath();
        let started = false;
        pts.forEach((p, i) => {
          if (p[key] == null) { started = false; return; }
          const x = (i / (span - 1)) * w;
          const y = h - 2 - ((p[key] * scale) / max) * (h - 14);
          if (started) ctx.lineTo(x, y); else { ctx.moveTo(x, y); started = true; }
        });
        ctx.stroke();
      }
      const last = pts[pts.length - 1];
      ch.value.textContent = last ? ch.lines.map(([k, s]) => (last[k] == null ? "–" : fmt(last[k] * s))).join(" / ") + ch.unit : "";
    }
  }

  function fmt(x) { return x >= 100 ? x.toFixed(0) : x >= 10 ? x.toFixed(1) : x.toFixed(2); }

  function onFrame(f) {
    state.frames += 1;
    state.last = f;
    document.getElementById("model").textContent = f.model;
    if (!f.replicas.length) {
      const v = replicaView(0);
      v.title.textContent = "No block map";
      v.counts.textContent = "this engine client does not report its block map";
    }
    for (const r of f.replicas) drawReplica(r);
    drawTiers((f.stats && f.stats.kv_tiers) || []);
    // A replica missing from a frame that has others (an engine core restarting) keeps its view, marked stale.
    const present = new Set(f.replicas.map((r) => r.replica));
    if (present.size) {
      for (const [index, v] of views) {
        if (!present.has(index)) v.counts.textContent = "no map from this replica now (dead or restarting); last seen above";
      }
    }
    if (f.point) {
      state.points.push(f.point);
      if (state.points.length > MAX_POINTS) state.points.splice(0, state.points.length - MAX_POINTS);
    }
    drawCharts();
  }

  // Counts of each state as this page decoded them (the tests compare them with the server's).
  state.decodedCounts = function (index) {
    const v = views.get(index || 0);
    const out = {};
    STATES.slice(0, COUNTED).forEach((s) => { out[s] = 0; });
    if (!v) return out;
    for (let i = 0; i < v.states.length; i++) if (v.states[i] < COUNTED) out[STATES[v.states[i]]] += 1;
    for (let i = 0; i < v.hostStates.length; i++) if (v.hostStates[i]) out.swapped += 1;
    return out;
  };

  // Where block `block` of replica `index` is drawn, and the first block in a state (the tests hover them).
  state.blockCenter = function (index, block) {
    const v = views.get(index || 0);
    const rect = v.map.getBoundingClientRect();
    return { x: rect.left + ((block % v.cols) + 0.5) * v.cell, y: rect.top + (Math.floor(block / v.cols) + 0.5) * v.cell };
  };
  state.firstBlock = function (index, name) {
    const v = views.get(index || 0);
    return v ? v.states.indexOf(STATES.indexOf(name)) : -1;
  };

  function connect() {
    const status = document.getElementById("status");
    const source = new EventSource("/dashboard/events");
    source.addEventListener("history", (ev) => {
      state.points = JSON.parse(ev.data).points.slice(-MAX_POINTS);
      drawCharts();
    });
    source.onmessage = (ev) => { status.textContent = "live"; status.className = "status on"; onFrame(JSON.parse(ev.data)); };
    source.onerror = () => { status.textContent = "disconnected, retrying…"; status.className = "status off"; };
  }
  connect();
})();
