"""pipeline.triton.stub_exit: a stub ends at once after its finalize, its output flushed; anything else that imports
a model's module keeps its own exit."""

from __future__ import annotations

import subprocess
import sys

PROGRAM = """
import sys
{stub}
from pipeline.triton.stub_exit import exit_without_teardown

class Teardown:
    def __del__(self):
        print("torn down", flush=True)

kept = Teardown()  # a module global: freed by the interpreter's teardown, never by os._exit
exit_without_teardown()
print("answered", end="")  # still in the buffer at exit: the handler must flush it
sys.exit(3)
"""


def run(stub: bool) -> subprocess.CompletedProcess:
    mark = 'sys.modules["c_python_backend_utils"] = object()  # what the stub imports first' if stub else ""
    return subprocess.run([sys.executable, "-c", PROGRAM.format(stub=mark)], capture_output=True, text=True,
                          timeout=60)


def test_in_a_stub_the_process_ends_without_the_teardown_and_its_output_flushed():
    done = run(stub=True)
    assert done.stdout == "answered" and done.returncode == 0, done  # pb_stub.cc's main returns 0 after teardown


def test_outside_a_stub_the_process_keeps_its_teardown_and_its_exit_status():
    done = run(stub=False)
    assert done.stdout == "answered" + "torn down\n" and done.returncode == 3, done
