"""A command killed with SIGTERM cleans up as after Ctrl-C (flows.console.stopped_like_ctrl_c)."""

import signal
import subprocess
import sys
import textwrap
import time

import psutil

CHILD = textwrap.dedent(
    """
    import subprocess, sys, time
    from pathlib import Path
    from flows.console import stopped_like_ctrl_c

    with stopped_like_ctrl_c():
        helper = subprocess.Popen(["sleep", "600"])  # as the campaign's cells
        try:
            print(helper.pid, flush=True)
            time.sleep(600)
        finally:
            helper.terminate()
            helper.wait()
            Path(sys.argv[1]).write_text("stopped")
    """
)


def test_a_sigterm_runs_the_cleanup_and_stops_what_the_command_started(tmp_path):
    marker = tmp_path / "cleaned-up"
    command = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(marker)], stdout=subprocess.PIPE, text=True
    )
    helper = int(command.stdout.readline())
    assert psutil.pid_exists(helper)
    command.send_signal(signal.SIGTERM)
    assert command.wait(timeout=30) != 0  # interrupted, not finished
    assert marker.read_text() == "stopped"
    deadline = time.monotonic() + 10
    while psutil.pid_exists(helper) and psutil.Process(helper).status() != "zombie":
        assert time.monotonic() < deadline, "the helper outlived the command"
        time.sleep(0.1)


def test_outside_it_sigterm_is_as_before():
    from flows.console import stopped_like_ctrl_c

    before = signal.getsignal(signal.SIGTERM)
    with stopped_like_ctrl_c():
        assert signal.getsignal(signal.SIGTERM) is not before
    assert signal.getsignal(signal.SIGTERM) is before
