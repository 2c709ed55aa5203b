"""A model test of revert on a real mount: random sequences of writes, appends, truncates,
deletes, renames, mkdir/rmdir, chmods and symlinks by two calls, the agent process itself
(between its calls) and an outside process; reverting a call gives the tree a simple model
predicts without that call's changes, or the conflicts the model predicts, and unrevert gives
back the tree before the revert.

The calls' writers are long-lived workers started during each call (so every write of theirs
is that call's), driven through FIFOs outside the workspace; the agent, once its calls have
ended, takes operations the same way and applies them in its own process (the session's own
writes, which a call's revert must not take for its own); the outside writer is this test
process itself, which descends from no agent.  Each generated case works in a directory of
its own and reverts with --path, so one mount serves all cases.  OVERLAYREC_MODEL_CASES sets the
number of cases; OVERLAYREC_MODEL_RANDOM=1 explores other cases than CI's fixed ones (with
pytest's ``--hypothesis-seed=N`` to repeat a run)."""
from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

from conftest import HAVE_FUSE, Mount, force_unmount, overlayrec

pytestmark = pytest.mark.skipif(not HAVE_FUSE, reason="needs /dev/fuse")

CASES = int(os.environ.get("OVERLAYREC_MODEL_CASES", "200"))
FIXED = not os.environ.get("OVERLAYREC_MODEL_RANDOM")  # CI: the same cases every run
NAMES = ["a", "b", "c"]

SERVE = textwrap.dedent(r'''
    import json
    def serve(fin, fout):
        """Apply each operation read from ``fin`` in this process; acknowledge it on ``fout``."""
        from op_apply import apply
        with open(fin) as cmds, open(fout, "w") as acks:
            for line in cmds:
                apply(json.loads(line))
                acks.write("ok\n"); acks.flush()
''')

WORKER = textwrap.dedent(r'''
    import sys
    from op_serve import serve
    serve(sys.argv[1], sys.argv[2])
''')

APPLY = textwrap.dedent(r'''
    import os
    def apply(op):
        kind, p = op["op"], op["path"]
        if kind == "write":
            with open(p, "w") as f: f.write(op["data"])
        elif kind == "append":
            with open(p, "a") as f: f.write(op["data"])
        elif kind == "delete":
            os.unlink(p)
        elif kind == "rename":
            os.rename(p, op["to"])
        elif kind == "chmod":
            os.chmod(p, 0o755 if op["exec"] else 0o644)
        elif kind == "symlink":
            os.symlink(op["target"], p)
        elif kind == "truncate":
            os.truncate(p, op["size"])
        elif kind == "mkdir":
            os.mkdir(p)
        elif kind == "rmdir":
            os.rmdir(p)
''')

AGENT = textwrap.dedent(r'''
    import os, subprocess, sys, time
    from overlayrec import client
    tmp = sys.argv[1]
    workers = []
    with client.connect() as c:
        for name in ("A", "B"):
            c.call_begin(name, "Worker")
            env = dict(os.environ, PYTHONPATH=tmp)
            workers.append(subprocess.Popen([sys.executable, os.path.join(tmp, "worker.py"),
                                             os.path.join(tmp, name + ".in"),
                                             os.path.join(tmp, name + ".out")], env=env))
            c.call_end(name)
    sys.path.insert(0, tmp)
    from op_serve import serve
    serve(os.path.join(tmp, "S.in"), os.path.join(tmp, "S.out"))  # the agent's own writes
    for w in workers:
        w.wait()
''')


class Env:
    def __init__(self):
        self.base = tempfile.mkdtemp(prefix="overlayrec-model-", dir="/var/tmp")
        os.chmod(self.base, 0o755)
        self.m = Mount(self.base)
        self.tmp = os.path.join(self.base, "ctl")
        os.makedirs(self.tmp)
        for name, text in (("worker.py", WORKER), ("op_apply.py", APPLY),
                           ("op_serve.py", SERVE), ("agent.py", AGENT)):
            with open(os.path.join(self.tmp, name), "w") as f:
                f.write(text)
        for n in ("A", "B", "S"):
            for suffix in (".in", ".out"):
                os.mkfifo(os.path.join(self.tmp, n + suffix))
        self.m.mount()
        self.run = subprocess.Popen([sys.executable, "-m", "overlayrec", "run", "-w", self.m.ws,
                                     "--session", "model", "--", sys.executable,
                                     os.path.join(self.tmp, "agent.py"), self.tmp], cwd=self.m.ws)
        self.pipes = {}
        for n in ("A", "B", "S"):
            # opening order matches the worker's: its input first, then its output
            self.pipes[n] = (open(os.path.join(self.tmp, n + ".in"), "w"),
                             open(os.path.join(self.tmp, n + ".out")))
        sys.path.insert(0, self.tmp)
        from op_apply import apply
        self.apply_outside = apply
        self.counter = itertools.count()

    def do(self, unit: str, op: dict) -> None:
        if unit == "O":
            self.apply_outside(op)
            return
        cin, cout = self.pipes[unit]
        cin.write(json.dumps(op) + "\n")
        cin.flush()
        assert cout.readline() == "ok\n"

    def close(self):
        for cin, cout in self.pipes.values():
            cin.close()
            cout.close()
        try:
            self.run.wait(timeout=30)
        finally:
            self.m.umount()
            force_unmount(self.m.ws)
            shutil.rmtree(self.base, ignore_errors=True)


@pytest.fixture(scope="module")
def env():
    e = Env()
    try:
        yield e
    finally:
        e.close()


def snapshot(d: str) -> dict:
    out = {}
    for n in sorted(os.listdir(d)):
        p = os.path.join(d, n)
        if os.path.islink(p):
            out[n] = ("link", os.readlink(p))
        elif os.path.isdir(p):
            out[n] = ("dir",)
        else:
            out[n] = ("file", open(p).read(), os.stat(p).st_mode & 0o111 != 0)
    return out


ops = st.lists(st.tuples(
    st.sampled_from(["A", "A", "B", "S", "O"]),
    st.sampled_from(["write", "append", "delete", "rename", "chmod", "symlink", "truncate",
                     "mkdir", "rmdir"]),
    st.sampled_from(NAMES), st.sampled_from(NAMES), st.text("xyz", min_size=1, max_size=3),
    st.booleans()), min_size=1, max_size=8)


def plan_ops(raw):
    """Keep only operations valid in the model's state; returns (ops, touched) in order."""
    state: dict = {}
    out = []
    for unit, kind, name, other, text, flag in raw:
        cur = state.get(name)
        if kind in ("write", "append") and (cur is None or cur[0] == "file"):
            if kind == "append" and cur is None:
                continue
            content = text if kind == "write" else cur[1] + text
            state[name] = ("file", content, cur[2] if cur else False)
            out.append((unit, {"op": kind, "path": name, "data": text}, [name]))
        elif kind == "truncate" and cur is not None and cur[0] == "file":
            size = len(cur[1]) // 2 if flag else len(cur[1]) + 2
            state[name] = ("file", cur[1][:size].ljust(size, "\0"), cur[2])
            out.append((unit, {"op": "truncate", "path": name, "size": size}, [name]))
        elif kind == "mkdir" and cur is None:
            state[name] = ("dir",)
            out.append((unit, {"op": "mkdir", "path": name}, [name]))
        elif kind == "rmdir" and cur is not None and cur[0] == "dir":
            del state[name]
            out.append((unit, {"op": "rmdir", "path": name}, [name]))
        elif kind == "delete" and cur is not None and cur[0] != "dir":
            del state[name]
            out.append((unit, {"op": "delete", "path": name}, [name]))
        elif kind == "rename" and cur is not None and other != name and \
                (state.get(other) is None or (cur[0] == "dir") == (state[other][0] == "dir")):
            state[other] = state.pop(name)
            out.append((unit, {"op": "rename", "path": name, "to": other}, [name, other]))
        elif kind == "chmod" and cur is not None and cur[0] == "file":
            state[name] = (cur[0], cur[1], flag)
            out.append((unit, {"op": "chmod", "path": name, "exec": flag}, [name]))
        elif kind == "symlink" and cur is None:
            state[name] = ("link", other)
            out.append((unit, {"op": "symlink", "path": name, "target": other}, [name]))
    return out


def predict(history: list, states: list, unit):
    """(conflict?, predicted tree) for reverting ``unit`` (or a set of units: a session's);
    states[i] is the tree after op i (states[-1]: before any)."""
    units = {unit} if isinstance(unit, str) else set(unit)
    final = states[len(history) - 1]
    mine = {}
    for i, (u, _, touched) in enumerate(history):
        if u in units:
            for p in touched:
                lo, hi = mine.get(p, (i, i))
                mine[p] = (min(lo, i), max(hi, i))
    if not mine:
        return None, final
    tree = dict(final)
    conflict = False
    for p, (first, last) in mine.items():
        target = states[first - 1].get(p)
        expected = states[last].get(p)
        if target == expected:
            # made and unmade by the selection: nothing to do, unless only earlier reverts
            # ("R") changed it since, and brought it back: then it goes, from what they left
            since = [i for i, (u, _, touched) in enumerate(history) if i > last and p in touched]
            if not (since and all(history[i][0] == "R" for i in since)) or \
                    states[since[-1]].get(p) == target:
                continue
            expected = states[since[-1]].get(p)
        if any(u not in units and p in touched for u, _, touched in history[first + 1:last]):
            conflict = True
        elif final.get(p) != expected:
            since = [u for u, _, touched in history[last + 1:] if p in touched]
            if final.get(p) == target and since and all(u == "R" for u in since):
                continue  # an earlier revert ("R") put it back: nothing to do
            before = [k for k in range(first) if p in history[k][2]]
            if not (since and all(u == "R" for u in since) and
                    any(states[k].get(p) == final.get(p) for k in range(first, last)) and
                    not any(states[j].get(p) == final.get(p)
                            for k in before for j in (k - 1, k))):
                conflict = True
            # else reverts stack: an earlier revert of part of the selection put back what
            # the path held within it (and never before it), and the selection goes on back
            # from there
        if target is None:
            tree.pop(p, None)
        else:
            tree[p] = target
    return conflict, tree


@pytest.mark.timeout(2400)  # the whole run of generated cases, not one of them
@settings(max_examples=CASES, deadline=None, derandomize=FIXED,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(raw=ops, which=st.sampled_from(["A", "A", "B"]),
       then=st.sampled_from([None, None, "other", "session"]))
def test_revert_matches_the_model(env, raw, which, then):
    history = plan_ops(raw)
    case = f"case{next(env.counter)}"
    d = os.path.join(env.m.ws, case)
    os.mkdir(d)
    model_states = {-1: {}}
    for i, (unit, op, touched) in enumerate(history):
        op = dict(op, path=os.path.join(d, op["path"]))
        if "to" in op:
            op["to"] = os.path.join(d, op["to"])
        env.do(unit, op)
        model_states[i] = snapshot(d)
    conflict, predicted = predict(history, model_states, which)
    before = snapshot(d)
    r = overlayrec("revert", env.m.ws, "--call", which, "--path", f"{case}/*", "--yes",
                   check=False)
    event("nothing to revert" if conflict is None else "conflict" if conflict else "reverted")
    if conflict is None:
        assert "nothing to revert" in r.stdout, (history, r.stdout, r.stderr)
        return
    if conflict:
        assert r.returncode == 1 and "conflicts" in r.stderr, (history, r.stdout, r.stderr)
        assert snapshot(d) == before
        return
    assert r.returncode == 0, (history, r.stdout, r.stderr)
    assert snapshot(d) == predicted, (history, r.stdout)
    if "reverted" in r.stdout:
        if then:  # the other call, or the session, reverted on top of it (the first revert
            # a unit of its own, "R")
            _then_the_other(env, case, d, history, model_states, which, before, then)
        u = overlayrec("unrevert", "-w", env.m.ws, "--yes", check=False)
        assert u.returncode == 0, (history, u.stdout, u.stderr)
        assert snapshot(d) == before, history


def _then_the_other(env, case, d, history, model_states, which, before, then) -> None:
    """Revert the other call (``then``: "other"), or the whole session ("session": both calls
    and the agent's own writes), after ``which``'s revert: the model's tree or its conflicts,
    the first revert an ordinary unit but for the paths it put back as they were before the
    selection (nothing to do); then unrevert it, back to the tree after the first revert."""
    after = snapshot(d)
    touched = [p for p in set(before) | set(after) if before.get(p) != after.get(p)]
    history2 = history + [("R", None, touched)]
    states2 = dict(model_states)
    states2[len(history)] = after
    if then == "other":
        units, selection = ("B" if which == "A" else "A"), ["--call", "B" if which == "A" else "A"]
    else:
        units, selection = {"A", "B", "S"}, ["--session", "model"]
    conflict, predicted = predict(history2, states2, units)
    r = overlayrec("revert", env.m.ws, *selection, "--path", f"{case}/*", "--yes", check=False)
    event(f"then the {then}: " + ("nothing to revert" if conflict is None else
                                  "conflict" if conflict else "reverted")
          + (" (put back already)" if "put back already" in r.stderr else ""))
    if conflict is None:
        assert "nothing to revert" in r.stdout, (history2, r.stdout, r.stderr)
    elif conflict:
        assert r.returncode == 1 and "conflicts" in r.stderr, (history2, r.stdout, r.stderr)
        assert snapshot(d) == after
    else:
        assert r.returncode == 0, (history2, r.stdout, r.stderr)
        assert snapshot(d) == predicted, (history2, r.stdout, r.stderr)
        if "reverted" in r.stdout:
            u = overlayrec("unrevert", "-w", env.m.ws, "--yes", check=False)
            assert u.returncode == 0, (history2, u.stdout, u.stderr)
            assert snapshot(d) == after, history2
