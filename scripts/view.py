"""One self-contained HTML page to read a run: its learning curves and the trajectories it kept.

    python scripts/view.py RUN_DIR [--out FILE] [--tokenizer PATH] [--steps 1,5,10-20] [--max_steps 20]
                                   [--max_mb 50] [--top 20]

RUN_DIR is an rl.py out_dir (metrics.jsonl; trajectories/step_NNNNNN.jsonl[.gz] from --save_trajectories) or an
evaluate.py --out dir (trajectories[.rankR].jsonl, summary.json). The page (RUN_DIR/view.html unless --out) needs
no network and no server: inline CSS, SVG and a little JS. It shows the step metrics as curves (held-out eval
accuracy as points) and, per step and per group (same uid), each trajectory as a conversation (prompt, reasoning,
each tool call's code, the tool's reply), its reward, advantage, score and finish reason. Everything is collapsed;
a trajectory's token view is built from its embedded JSON record only when opened: sampled tokens (loss mask 1)
tinted by the advantage sign, forced tool-reply tokens (mask 0) in blue, and the --top tokens where the trainer's
and the sampler's log-probs differ most outlined (values in the tooltip). Token strings come from the run's
tokenizer (RUN_DIR/final, the newest RUN_DIR/step_*, the model in summary.json, or --tokenizer); without one the
page shows token ids. `#open=ID,...` in the URL opens those elements (e.g. view.html#open=s3g0t1k).
With more steps kept than --max_steps, or more than --max_mb of them, fewer steps spread evenly from the first to the
last are shown (--steps names them instead); a paper-scale step (16 x 20k tokens) makes ~12 MB of page. A page
of fewer steps (--steps, a smaller --max_steps or --max_mb) is named for them (view_steps_1_5.html): it never
replaces view.html.
"""
import argparse
import glob
import gzip
import html
import json
import os
import re
import sys

CURVES = ["reward", "accuracy", "tool_calls_per_traj", "response_length", "entropy", "clip_high", "clip_low",
          "clip_dual"]
# a call ends at </tool_call>, else where its turn ends (a tool reply may quote "</tool_call>" in an error)
BLOCK_RE = re.compile(r"(<tool_call>(?:(?!<\|im_end\|>|<tool_response>).)*?(?:</tool_call>|(?=<\|im_end\|>|"
                      r"<tool_response>)|$)|<tool_response>.*?(?:</tool_response>|$))", re.S)
SCAFFOLD_RE = re.compile(r"<\|im_start\|>(?:assistant|user|system|tool)\n?|<\|im_end\|>\n?|<\|endoftext\|>")


def read_jsonl(path):
    """The records of a .jsonl or .jsonl.gz file; a torn last line (a killed writer) is skipped."""
    rows = []
    with (gzip.open(path, "rt", encoding="utf-8") if path.endswith(".gz") else open(path, encoding="utf-8")) as f:
        for line in f:
            try:   # NaN and Infinity (a tool call's 1e999) as text: JSON.parse takes no other
                rows.append(json.loads(line, parse_constant=str))
            except (ValueError, RecursionError):
                continue
    return rows


def load_run(run_dir):
    """(kind "rl" | "eval", metric rows by step, summary, {step (None: an evaluation): [trajectory files]})."""
    summary = {}
    if os.path.exists(os.path.join(run_dir, "summary.json")):
        summary = json.load(open(os.path.join(run_dir, "summary.json"), encoding="utf-8"))
    elif os.path.exists(os.path.join(run_dir, "result.json")):   # an RL run's held-out eval: RUN_DIR/eval/step_N
        summary = json.load(open(os.path.join(run_dir, "result.json"), encoding="utf-8")).get("summary", {})
    rows = {}
    if os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
        for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")):
            if r.get("event") == "step":
                rows[r["step"]] = r   # after a resume the last line of a step wins
    files = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "trajectories", "step_*.jsonl*"))):
        files.setdefault(int(re.search(r"step_(\d+)", os.path.basename(path)).group(1)), []).append(path)
    evals = sorted(glob.glob(os.path.join(run_dir, "trajectories*.jsonl")))
    if evals and not files:
        files[None] = evals
    kind = "rl" if rows or os.path.isdir(os.path.join(run_dir, "trajectories")) else "eval"
    return kind, [rows[s] for s in sorted(rows)], summary, files


def data_size(path):
    """Bytes of JSON in a trajectory file (a .gz file's trailer holds its uncompressed size, mod 4 GiB)."""
    if not path.endswith(".gz"):
        return os.path.getsize(path)
    with open(path, "rb") as f:
        f.seek(-4, 2)
        return int.from_bytes(f.read(4), "little")


def choose_steps(available, spec="", max_steps=20, sizes=None, max_bytes=float("inf")):
    """The steps to show: those named in spec ("1,5,10-20"); else up to max_steps spread evenly from the first to
    the last, fewer while their trajectories (sizes: bytes per step) hold more than max_bytes; at least the last."""
    if spec:
        wanted = set()
        for part in spec.split(","):
            lo, _, hi = part.strip().partition("-")
            wanted.update(range(int(lo), int(hi or lo) + 1))
        return [s for s in available if s in wanted]
    for k in range(min(max_steps, len(available)), 0, -1):
        picks = [available[round(i * (len(available) - 1) / (k - 1))] for i in range(k)] if k > 1 else available[-1:]
        if k == 1 or sum((sizes or {}).get(s, 0) for s in picks) <= max_bytes:
            return picks
    return []


def find_tokenizer(run_dir, explicit=None, summary=None):
    """(tokenizer or None, where it came from): --tokenizer, RUN_DIR (or up to two levels above it)/final or its
    newest step_*, then the model named by summary.json (an evaluation, or an RL run's config)."""
    candidates = [explicit] if explicit else []
    if not explicit:
        here = os.path.abspath(run_dir)
        for d in (here, os.path.dirname(here), os.path.dirname(os.path.dirname(here))):
            candidates += [os.path.join(d, "final")] + sorted(glob.glob(os.path.join(d, "step_*")), reverse=True)
        summary = summary or {}
        candidates += [summary.get("model"), (summary.get("config") or {}).get("model")]
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return None, "transformers is not installed"
    for path in filter(None, candidates):
        if os.path.isdir(path) and not glob.glob(os.path.join(path, "tokenizer*")):
            continue
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            return tokenizer, os.path.relpath(path) if os.path.isdir(path) else path
        except Exception:   # not a tokenizer, or a hub id that is not cached
            continue
    return None, "no tokenizer found (pass --tokenizer PATH)"


def token_pieces(tokenizer, ids, cache):
    """One display string per token. A run of tokens that only together make a character (byte-level BPE splits
    an emoji over several) is decoded as one: its text goes to its first token, "" to the others."""
    new = sorted({i for i in ids if i not in cache})
    if new:
        cache.update(zip(new, tokenizer.batch_decode([[i] for i in new], skip_special_tokens=False,
                                                     clean_up_tokenization_spaces=False)))
    out, i = [cache[t] for t in ids], 0
    while i < len(ids):
        if "\ufffd" in out[i]:
            for j in range(i + 2, min(i + 8, len(ids)) + 1):
                text = tokenizer.decode(ids[i:j], skip_special_tokens=False, clean_up_tokenization_spaces=False)
                if "\ufffd" not in text:
                    out[i:j], i = [text] + [""] * (j - i - 1), j - 1
                    break
        i += 1
    return out


def response_blocks(text, tool_calls):
    """The response as [(kind, text, call)]: kind "text" (reasoning, chat scaffolding dropped), "call" (the code
    of a <tool_call>, with its tool_calls record: status, output) or "reply" (a <tool_response>'s content)."""
    blocks, turn, replied, taken = [], 0, False, {}
    for part in BLOCK_RE.split(text):
        if part.startswith("<tool_response>"):
            blocks.append(("reply", part[len("<tool_response>"):].removesuffix("</tool_response>").strip("\n"), None))
            replied = True
            continue
        if not part.startswith("<tool_call>"):
            part = SCAFFOLD_RE.sub("", part).strip()
            if not part:
                continue
        if replied:   # the first content after a tool reply opens the next assistant turn
            turn, replied = turn + 1, False
        if not part.startswith("<tool_call>"):
            blocks.append(("text", part, None))
            continue
        body = part[len("<tool_call>"):].removesuffix("</tool_call>").strip()
        try:   # the code of a code_interpreter call; another tool's call as its JSON
            call = json.loads(body)
            args = json.loads(call["arguments"]) if isinstance(call["arguments"], str) else call["arguments"]
            code = args["code"] if call.get("name") == "code_interpreter" else body
        except (ValueError, TypeError, KeyError, RecursionError):
            code = body
        mine = [c for c in tool_calls if c.get("turn") == turn]
        k = taken[turn] = taken.get(turn, -1) + 1
        blocks.append(("call", str(code), mine[k] if k < len(mine) else None))
    return blocks


def plural(n, one, many=None):
    return f"{n} {one if n == 1 else many or one + 's'}"


def fmt(v, spec="+.3f"):
    return "n/a" if v is None else format(v, spec)


def chart(name, points, extra=()):
    """A small inline SVG line chart of [(step, value)]; extra: [(step, value)] drawn as orange points."""
    w, h, left, right, top, bottom = 300, 150, 50, 10, 20, 24
    pts = [(s, v) for s, v in points if isinstance(v, (int, float))]
    allp = pts + list(extra)
    x0, x1 = min(s for s, _ in allp), max(s for s, _ in allp)
    y0, y1 = min(v for _, v in allp), max(v for _, v in allp)
    if y0 == y1:
        y0, y1 = y0 - (abs(y0) or 1) * 0.05, y1 + (abs(y1) or 1) * 0.05
    sx = lambda s: left + (s - x0) / ((x1 - x0) or 1) * (w - left - right)
    sy = lambda v: h - bottom - (v - y0) / (y1 - y0) * (h - top - bottom)
    out = [f'<svg class="chart" width="{w}" height="{h}" viewBox="0 0 {w} {h}">',
           f'<text x="{left}" y="13" class="ct">{html.escape(name)}</text>',
           f'<rect x="{left}" y="{top}" width="{w - left - right}" height="{h - top - bottom}" class="frame"></rect>',
           f'<text x="{left - 3}" y="{top + 8}" class="ax" text-anchor="end">{y1:.3g}</text>',
           f'<text x="{left - 3}" y="{h - bottom}" class="ax" text-anchor="end">{y0:.3g}</text>',
           f'<text x="{left}" y="{h - 8}" class="ax">{x0}</text>',
           f'<text x="{w - right}" y="{h - 8}" class="ax" text-anchor="end">step {x1}</text>']
    if pts:
        line = " ".join(f"{sx(s):.1f},{sy(v):.1f}" for s, v in pts)
        out.append(f'<polyline points="{line}" class="line"></polyline>')
    dots = [(s, v, "dot") for s, v in pts] * (len(pts) <= 200) + [(s, v, "ev") for s, v in extra]
    out += [f'<circle cx="{sx(s):.1f}" cy="{sy(v):.1f}" r="{2 if c == "dot" else 3.5}" class="{c}">'
            f'<title>step {s}: {v:.5g}{" (eval)" if c == "ev" else ""}</title></circle>' for s, v, c in dots]
    return "".join(out) + "</svg>"


def curves(rows, summary):
    evals = [(r["step"], r["eval"]["accuracy"]) for r in rows
             if isinstance(r.get("eval"), dict) and r["eval"].get("accuracy") is not None]
    if (summary.get("before") or {}).get("accuracy") is not None:
        evals.insert(0, (0, summary["before"]["accuracy"]))
    charts = []
    for name in CURVES:
        pts = [(r["step"], r[name]) for r in rows if isinstance(r.get(name), (int, float))]
        extra = evals if name == "accuracy" else []
        if pts or extra:
            charts.append(chart(name + (" (orange: held-out eval)" if extra else ""), pts, extra))
    return '<div class="charts">' + "".join(charts) + "</div>" if charts else "<p>No step metrics.</p>"


def user_text(prompt):
    """The last user turn of a rendered prompt (the problem), for the group's one-line title."""
    turns = re.findall(r"<\|im_start\|>user\n(.*?)(?:<\|im_end\|>|$)", prompt, re.S)
    return (turns[-1] if turns else prompt).strip()


def script_json(obj):
    """JSON that is safe inside <script>: every "<" escaped (no "</script>" or "<!--" can close it)."""
    return json.dumps(obj, ensure_ascii=False).replace("<", "\\u003c")


def gaps(rec, top):
    """(the sampled tokens to outline, largest |trainer - sampler| log-prob gap first, at most top;
    the token view's key for them). A gap within what rounding makes is never outlined: rl.py stores
    log-probs to 4 significant digits, and on CPU both sides compute in fp32 (gaps ~1e-6)."""
    lp, tlp, mask = rec.get("logprobs") or [], rec.get("trainer_logprobs"), rec.get("loss_mask") or []
    if not (tlp and lp):
        return [], ""
    gap = {i: abs(t - s) for i, (t, s, m) in enumerate(zip(tlp, lp, mask)) if m}
    real = [i for i, g in gap.items() if g > 1e-3 * max(abs(tlp[i]), abs(lp[i])) + 1e-6]
    ranked = sorted(real, key=lambda i: (-gap[i], i))[:top]
    largest = max(gap.values(), default=0.0)
    if ranked:
        return ranked, f"top {len(ranked)} by |trainer - sampler| log-prob"
    if largest == 0:
        return [], "trainer and sampler log-probs equal (as stored)"
    return [], (f"trainer and sampler agree to rounding (largest |diff| {largest:.2g}, log-probs stored "
                f"to 4 significant digits): nothing outlined")


def trajectory(rec, key, tokenizer, cache, top):
    """A trajectory's <details>: summary line, conversation blocks, the lazy token view and its JSON."""
    mask, calls = rec.get("loss_mask") or [], rec.get("tool_calls") or []
    bits = [f'#{rec.get("sample_index", "?")}']
    if rec.get("reward") is not None:
        bits.append(f'reward {fmt(rec["reward"])}')
    if rec.get("advantage") is not None:
        bits.append(f'<span class="{"p" if rec["advantage"] > 0 else "n" if rec["advantage"] < 0 else ""}">'
                    f'adv {fmt(rec["advantage"])}</span>')
    if "score" in rec or "correct" in rec:
        bits.append(f'score {fmt(rec.get("score"), ".2f")} ' + ('<span class="p">correct</span>' if rec.get("correct")
                                                                else '<span class="n">wrong</span>'))
    bits.append(html.escape(str(rec.get("finish_reason"))))
    bits.append(plural(len(calls), "call") + (" (" + ", ".join(
        html.escape(str(c.get("status"))) for c in calls) + ")" if calls else ""))
    bits.append(f'{len(rec.get("response_ids") or [])} tokens, {sum(mask)} sampled')
    lp, tlp = rec.get("logprobs") or [], rec.get("trainer_logprobs")
    outlined, note = gaps(rec, top)
    if tlp and lp:
        diffs = [abs(t - s) for t, s, m in zip(tlp, lp, mask) if m]
        bits.append(f"max |trainer-sampler| {max(diffs, default=0):.2g}"
                    + (" (rounding)" if max(diffs, default=0) and not outlined else ""))
    conv = []
    for kind, text, call in response_blocks(rec.get("text", ""), calls):
        label = {"text": "model", "reply": "tool reply"}.get(kind) or "tool call" + (
            f' · {html.escape(str(call.get("status")))}' if call else " · not run")
        conv.append(f'<div class="b {kind}"><div class="lbl">{label}</div><pre>{html.escape(text)}</pre></div>')
    ids = rec.get("response_ids") or []
    pieces = token_pieces(tokenizer, ids, cache) if tokenizer is not None else None
    return (f'<details class="traj" id="{key}"><summary>{" · ".join(bits)}</summary>'
            f'<div class="conv">{"".join(conv)}</div>'
            f'<details class="tok" id="{key}k" data-src="{key}j"><summary>token view '
            f'({len(ids)} tokens; built when opened)</summary><div class="tokens"></div></details>'
            f'<script type="application/json" id="{key}j">'
            f'{script_json({"record": rec, "pieces": pieces, "outlined": outlined, "note": note})}</script>'
            "</details>")


def group_html(records, key, tokenizer, cache, top):
    records = sorted(records, key=lambda r: r.get("sample_index", 0))
    first = records[0]
    prompt = first.get("prompt")
    if prompt is None and tokenizer is not None and first.get("prompt_ids"):
        prompt = tokenizer.decode(first["prompt_ids"], skip_special_tokens=False)
    prompt = prompt if prompt is not None else "(no prompt text stored and no tokenizer to decode prompt_ids)"
    title = user_text(prompt).splitlines()[0][:100] if user_text(prompt) else ""
    marks = "".join('<span class="p">&#10003;</span>' if r.get("correct") else '<span class="n">&#10007;</span>'
                    for r in records)
    rewards = [r["reward"] for r in records if r.get("reward") is not None]
    extra = (f" · mean reward {sum(rewards) / len(rewards):+.3f}" if rewards else "") + \
        (" · rewards all equal" if len(rewards) > 1 and len(set(rewards)) == 1 else "")
    trajs = "".join(trajectory(r, f"{key}t{j}", tokenizer, cache, top) for j, r in enumerate(records))
    return (f'<details class="group" id="{key}"><summary>{html.escape(str(first.get("uid")))} {marks}{extra} · '
            f'<i>{html.escape(title)}</i></summary><details class="prompt"><summary>prompt</summary>'
            f'<pre>{html.escape(prompt)}</pre></details>{trajs}</details>')


def step_html(step, records, tokenizer, cache, top):
    groups = {}
    for r in records:
        groups.setdefault(r.get("uid", r.get("problem_index")), []).append(r)
    key = f"s{step if step is not None else 'e'}"
    n = len(records)
    correct = sum(bool(r.get("correct")) for r in records)
    rewards = [r["reward"] for r in records if r.get("reward") is not None]
    head = ("evaluation" if step is None else f"step {step}") + f" · {plural(len(groups), 'group')} · " \
        f"{plural(n, 'trajectory', 'trajectories')} · " \
        f"{correct}/{n} correct" + (f" · mean reward {sum(rewards) / len(rewards):+.3f}" if rewards else "")
    body = "".join(group_html(g, f"{key}g{k}", tokenizer, cache, top) for k, g in enumerate(groups.values()))
    return f'<details class="step" id="{key}"{" open" * (step is None)}><summary>{head}</summary>{body}</details>'


def percent(column):
    """Whether evaluate.py's terminal table gives the column in %: avg@n, pass@k, maj@k, verl's, the headline."""
    return column == "headline" or re.match(r"^(avg|pass|maj|verl_\w+)@\d+(/mean)?$", column) is not None


def summary_table(summary):
    """An evaluation summary's scalar figures, overall and per benchmark; accuracies in % as the terminal shows them."""
    parts = {"overall": summary.get("overall", {}), **summary.get("benchmarks", {})}
    cols = [k for k, v in parts["overall"].items() if isinstance(v, (int, float))]
    head = "".join(f"<th>{html.escape(c)}{' (%)' * percent(c)}</th>" for c in cols)

    def cell(v, c):
        if not isinstance(v, (int, float)):
            return "<td></td>"
        return f"<td>{100 * v:.1f}</td>" if percent(c) else f"<td>{v:.4g}</td>"
    body = "".join(f"<tr><td>{html.escape(n)}</td>" + "".join(cell(p.get(c), c) for c in cols) + "</tr>"
                   for n, p in parts.items())
    return f"<table><tr><th></th>{head}</tr>{body}</table>" if cols else ""


CSS = """body{font:13px system-ui,sans-serif;margin:16px;color:#222}h1{font-size:18px}pre{white-space:pre-wrap;
word-break:break-word;margin:2px 0;font:12px ui-monospace,monospace}summary{cursor:pointer;padding:2px 0}
details{margin:2px 0 2px 14px}details.step>summary{font-weight:600}.charts{display:flex;flex-wrap:wrap;gap:6px}
.chart .ct{font-size:11px;font-weight:600}.chart .ax{font-size:10px;fill:#666}.frame{fill:none;stroke:#ccc}
.line{fill:none;stroke:#2266cc;stroke-width:1.5}.dot{fill:#2266cc}.ev{fill:#f28c00}.p{color:#187a18}
.n{color:#c0262d}.b{border-left:4px solid #bbb;padding:2px 8px;margin:4px 0;background:#fafafa}
.b.call{border-color:#7a4ad9;background:#f4f0fc}.b.reply{border-color:#2f7fd0;background:#eef5fc}
.lbl{font-size:11px;color:#666}table{border-collapse:collapse}td,th{border:1px solid #ddd;padding:2px 6px}
.tokens{font:12px ui-monospace,monospace;white-space:pre-wrap;word-break:break-word;line-height:1.7}
.tokens span{border-radius:2px;box-shadow:inset -1px 0 rgba(0,0,0,.18)}.tp{background:#d6f0d0}
.tn{background:#f7d4d4}.t0{background:#ececec}
.tf{background:#d4e3f7;color:#24518a}.top{outline:2px solid #f28c00;background:#ffe2a8}
.key span{padding:0 4px;margin-right:6px}"""

JS = """const esc = s => s.replace(/[&<>"]/g, c => ({'&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;'}[c]));
const num = v => v === undefined || v === null ? 'n/a' : v.toPrecision(4);
function build(d) {
  const el = d.querySelector('.tokens');
  if (el.dataset.done) return;
  el.dataset.done = 1;
  const {record: r, pieces, outlined, note} = JSON.parse(document.getElementById(d.dataset.src).textContent);
  const ids = r.response_ids || [], m = r.loss_mask || [], lp = r.logprobs || [], tlp = r.trainer_logprobs;
  const adv = r.advantage, tint = adv > 0 ? 'tp' : adv < 0 ? 'tn' : 't0';
  const top = new Map(outlined.map((i, k) => [i, k + 1]));  // view.gaps chose them
  const out = ['<div class="key"><span class="' + tint + '">sampled (mask 1)' +
    (adv === undefined ? '' : ', advantage ' + num(adv)) + '</span><span class="tf">forced tool reply (mask 0)</span>' +
    (note ? '<span class="' + (top.size ? 'top' : '') + '">' + esc(note) + '</span>' : '') +
    (pieces ? '' : ' no tokenizer: token ids shown') + '</div>'];
  for (let i = 0; i < ids.length; i++) {
    let t = '#' + i + ' id ' + ids[i] + (m[i] ? ' sampled, sampler logp ' + num(lp[i]) : ' forced (mask 0)');
    if (tlp && m[i]) t += ', trainer logp ' + num(tlp[i]) + ', |diff| ' + num(Math.abs(tlp[i] - lp[i]));
    if (top.has(i)) t += ' (rank ' + top.get(i) + ')';
    out.push('<span class="' + (m[i] ? tint : 'tf') + (top.has(i) ? ' top' : '') + '" title="' + esc(t) + '">' +
             esc(pieces ? pieces[i] : '[' + ids[i] + ']') + '</span>');
  }
  el.innerHTML = out.join('');
}
document.addEventListener('toggle', e => {
  if (e.target.open && e.target.classList.contains('tok')) build(e.target);
}, true);
function openHash() {
  const h = location.hash.match(/open=([^&]+)/);
  for (const id of h ? decodeURIComponent(h[1]).split(',') : []) {
    const first = document.getElementById(id);
    for (let e = first; e; e = e.parentElement) if (e.tagName === 'DETAILS') e.open = true;
    if (first && first.classList.contains('tok')) build(first);
  }
}
openHash();
window.addEventListener('hashchange', openHash);"""


def render(run_dir, tokenizer_path=None, steps_spec="", max_steps=20, max_mb=50, top=20):
    kind, rows, summary, files = load_run(run_dir)
    if not (rows or summary or files):
        raise SystemExit(f"{run_dir}: nothing to show (no metrics.jsonl, summary.json or "
                         f"trajectories: an rl.py --out_dir or an evaluate.py --out is expected)")
    tokenizer, source = find_tokenizer(run_dir, tokenizer_path, summary) if files else (None, "not needed")
    sizes = {s: sum(map(data_size, paths)) for s, paths in files.items()}
    shown = choose_steps(sorted(files, key=lambda s: -1 if s is None else s), steps_spec, max_steps, sizes,
                         max_mb * 1e6)
    steps = {s: [rec for path in files[s] for rec in read_jsonl(path)] for s in shown}
    cache, n = {}, sum(len(steps[s]) for s in shown)
    info = ["an RL run" if kind == "rl" else "an evaluation",
            f"{n} trajectories in {len(shown)} of the {len(files)} steps kept (--steps, --max_steps, --max_mb choose)"
            if kind == "rl" else f"{n} trajectories",
            f"tokenizer: {html.escape(str(source))}" if tokenizer else
            f"<b>token strings unavailable</b> ({html.escape(source)}): text blocks only, token ids in the token view"]
    for when in ("before", "after"):
        if (summary.get(when) or {}).get("accuracy") is not None:
            info.append(f"held-out accuracy {when} RL: {summary[when]['accuracy']:.3f}")
    if kind == "rl" and not files:
        info.append("no trajectories kept (rl.py --save_trajectories N keeps N groups per step)")
    evals = sorted(glob.glob(os.path.join(run_dir, "eval", "step_*")))
    if evals:
        info.append("held-out evaluations: <code>python scripts/view.py " + html.escape(os.path.join(
            run_dir, "eval", "step_N")) + "</code> for N in " + ", ".join(os.path.basename(e)[5:] for e in evals))
    name = html.escape(os.path.normpath(run_dir))
    parts = [f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>{name}</title><style>{CSS}</style></head>'
             f"<body><h1>{name}</h1>",
             "<div>" + "<br>".join(info) + "</div>",
             "<h2>Learning curves</h2>" + curves(rows, summary) if kind == "rl" else summary_table(summary),
             "<h2>Trajectories</h2>"]
    parts += [step_html(s, steps[s], tokenizer, cache, top) for s in shown]
    parts.append(f"<script>{JS}</script></body></html>")
    return "\n".join(parts)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", help="an rl.py out_dir or an evaluate.py --out dir")
    ap.add_argument("--out", help="the HTML file to write (default RUN_DIR/view.html)")
    ap.add_argument("--tokenizer", help="a tokenizer dir or hub id (default: found from the run)")
    ap.add_argument("--steps", default="", help="steps to show, e.g. 1,5,10-20 (default: all, up to --max_steps)")
    ap.add_argument("--max_steps", type=int, default=20, help="at most this many steps, spread evenly")
    ap.add_argument("--max_mb", type=float, default=50, help="fewer steps while their trajectories exceed this")
    ap.add_argument("--top", type=int, default=20, help="tokens outlined per trajectory by |trainer - sampler|")
    args = ap.parse_args(argv)
    if not os.path.isdir(args.run_dir):
        raise SystemExit(f"{args.run_dir}: not a directory")
    page = render(args.run_dir, args.tokenizer, args.steps, args.max_steps, args.max_mb, args.top)
    # a page of fewer steps than the defaults choose gets a name of its own: view.html, the
    # default page, is never replaced by a narrower one
    picked = [f"steps_{re.sub(r'[^0-9-]+', '_', args.steps)}" * bool(args.steps),
              f"max_steps_{args.max_steps}" * (args.max_steps < 20),
              f"max_mb_{args.max_mb:g}" * (args.max_mb < 50)]
    name = "_".join(filter(None, picked))
    out = args.out or os.path.join(args.run_dir, f"view_{name}.html" if name else "view.html")
    with open(out, "w", encoding="utf-8", errors="backslashreplace") as f:  # lone surrogates
        f.write(page)
    kept = "; view.html stays the default page" if name and not args.out else ""
    print(f"wrote {out} ({os.path.getsize(out) / 1e6:.2f} MB){kept}")


if __name__ == "__main__":
    sys.exit(main())
