"""exits.leave: how ``python -m mpitrain`` ends once its runs are over (in fresh
interpreters; TensorFlow stands in as an empty module, what leave looks for)."""

import subprocess
import sys
import textwrap

# a process whose run is over: an exit handler (as MPI's finalize), output not yet
# flushed, and an object whose finalizer runs only in the interpreter's teardown
SCRIPT = textwrap.dedent("""
    import atexit, sys, threading, time, types
    if "{tf}" == "yes":
        sys.modules["tensorflow"] = types.ModuleType("tensorflow")
    if "{thread}" == "yes":
        threading.Thread(target=lambda: (time.sleep(0.5), print("thread done"))).start()
    class Teardown:
        def __del__(self):
            print("interpreter teardown", file=sys.stderr, flush=True)
    keep = [Teardown()]
    keep.append(keep)  # a cycle: freed by the teardown's last collection, not at atexit
    atexit.register(lambda: print("exit handler ran"))
    print("run output")
    from mpitrain.cli.exits import leave
    leave({code})
""")


def run(code=3, tf="yes", thread="no"):
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(code=code, tf=tf, thread=thread)],
                          capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout.splitlines(), done.stderr


def test_leave_skips_the_teardown_after_the_exit_handlers():
    code, out, err = run(3)
    assert code == 3
    assert out == ["run output", "exit handler ran"]  # flushed, in order
    assert "interpreter teardown" not in err, err


def test_leave_exits_as_usual_without_tensorflow_or_with_a_thread_running():
    """A tool's process (no TensorFlow) ends the ordinary way, and so does one with a
    thread that is not a daemon: the interpreter waits for it."""
    code, out, err = run(0, tf="no")
    assert code == 0 and out == ["run output", "exit handler ran"]
    assert "interpreter teardown" in err
    code, out, err = run(5, thread="yes")
    assert code == 5 and out[-2:] == ["thread done", "exit handler ran"], out
