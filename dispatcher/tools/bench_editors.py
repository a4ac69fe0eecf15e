"""The bench's editor replays: users typing into their own files, each keystroke a
request that closes the last one (the typing trace), and one editor's fill-in-the-middle
keystrokes superseding each other (the FIM replay)."""
from __future__ import annotations

import threading
import time

from dispatcher.tools.bench_corpus import opening
from dispatcher.tools.bench_targets import Abort, Level, Sample, percentile, summarize


def run_fim_replay(target, keystrokes: int, max_tokens: int, salt: int,
                   interval: float, text: str) -> Level:
    """An editor session in `text` (a file): the prefix grows a few characters per
    keystroke, a request per keystroke, each one superseding the last (X-Session-Id);
    the text after the cursor is the suffix."""
    text = opening(text, 2000)
    cut = text.rfind("\n", 0, len(text) // 2) + 1 or len(text) // 2
    end = cut + 3 * keystrokes                   # the suffix: after what is typed
    suffix = text[end:end + 400]
    # (a shorter prefix: the first keystroke is the probe's and 3 characters more, as
    # every later one is the last one's; it was the probe's prompt again, all cached)
    probe = target.complete(text[:max(1, cut - 3)], 1, suffix=suffix)
    if probe.error and "fim_unsupported" in probe.error or \
            probe.error and "suffix" in probe.error:
        # a model without FIM tokens, or a server without `suffix` on this route
        # (llama-server: /infill only): the prefix alone grows, a workload of its own,
        # named so (its figures are not the FIM ones of a server that took the suffix)
        suffix = None
    session = f"bench-{salt}"
    samples: list[Sample] = []
    threads = []
    lock = threading.Lock()

    def fire(prefix):
        sample = target.complete(prefix, max_tokens, suffix=suffix, session=session)
        with lock:
            samples.append(sample)

    started = time.perf_counter()
    for i in range(keystrokes):
        t = threading.Thread(target=fire, args=(text[:cut + 3 * i],))
        t.start()
        threads.append(t)
        time.sleep(interval)
    for t in threads:
        t.join()
    return summarize("FIM keystrokes" if suffix is not None else
                     "keystrokes (prefix only: suffix refused)", 1, samples,
                     time.perf_counter() - started)


def run_typing(target, sessions: int, bursts: int, burst_len: int, gap: float,
               max_tokens: int, salt: int, session_seq: bool = False,
               session_name: str | None = None, header: bool = False,
               keep_stale: bool = False, fim: bool = False,
               files: list[str] | None = None) -> Level:
    """Editors typing: `sessions` users, each typing bursts of `burst_len` keystrokes
    `gap` s apart into its own file (the first ~1,600 characters of one of `files`), one request per keystroke, a pause after
    each burst. As the plugins do (../shared/notes/editor-clients.md), each keystroke
    closes the previous keystroke's connection at once and no session header is sent;
    `keep_stale` leaves it open instead (a client that has not read anything yet), and
    `header` sends X-Session-Id (`session_seq`: and X-Session-Seq, the user's count);
    `fim` sends the text after the cursor as `suffix` (servers with FIM only).

    Reports, for the request the user waits for (the last of each burst): TTFT, time to
    the end of the first line (p50 and p95), and how many never showed a suggestion
    (`unanswered`); `closed` counts the stale requests closed."""
    waited: list[Sample] = []
    closed = 0
    lock = threading.Lock()
    name = session_name or f"typing-{salt}"
    header = header or session_seq

    def user(u: int) -> None:
        nonlocal closed
        text = opening(files[u], 1600)
        cursor = len(text) // 2
        count = 0
        for b in range(bursts):
            threads, results, aborts = [], {}, []
            for k in range(burst_len):
                cursor += 2
                count += 1
                prefix = text[:cursor] + "\n    "
                if aborts and not keep_stale:
                    aborts[-1].close()            # the plugin drops the stale request
                abort = Abort()
                aborts.append(abort)

                def fire(key=k, prefix=prefix, seq=count if session_seq else None,
                         abort=abort, suffix=text[cursor:cursor + 200] if fim else None):
                    results[key] = target.complete(
                        prefix, max_tokens, suffix=suffix,
                        session=f"{name}-{u}" if header else None, seq=seq, abort=abort)
                thread = threading.Thread(target=fire)
                thread.start()
                threads.append(thread)
                time.sleep(gap)
            for thread in threads:
                thread.join()
            with lock:
                waited.append(results[burst_len - 1])
                closed += sum(1 for r in results.values() if r.closed)
            time.sleep(gap * 3)

    started = time.perf_counter()
    users = [threading.Thread(target=user, args=(u,)) for u in range(sessions)]
    for thread in users:
        thread.start()
    for thread in users:
        thread.join()
    mode = ("stale kept open" if keep_stale else "plugin-like") + \
        (", FIM" if fim else "") + \
        (", X-Session-Seq" if session_seq else ", X-Session-Id" if header else "")
    level = summarize(f"typing ({mode})", sessions, waited, time.perf_counter() - started)
    lines = [s.first_line * 1000 for s in waited if s.ok and s.first_line is not None]
    level.first_line_p50_ms = percentile(lines, 0.5)
    level.first_line_p95_ms = percentile(lines, 0.95)
    level.unanswered = sum(1 for s in waited if not s.ok)
    # (answered with nothing to show: in no TTFT or first line figure, so counted here;
    # a server answering empty under load must not look faster for it)
    level.empty = sum(1 for s in waited if s.ok and s.ttft is None)
    level.closed = closed
    return level
