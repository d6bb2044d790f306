"""Starting the processes that tests run: an environment without a GPU, torch.distributed jobs on
a free loopback port (launched again when another program takes the port first), and reads of
a process's output that end at a deadline."""
import os
import socket
import subprocess
import sys
import threading
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/helpers/ -> the repository
LAUNCH_ATTEMPTS = 3        # launches of a job whose port another program took in between
PORT_TAKEN = ("eaddrinuse", "address already in use")   # how the launcher and gloo report that


def cpu_env(**extra):
    """os.environ for a process that sees no GPU (CUDA_VISIBLE_DEVICES=""), as on a machine
    without one, with `extra` on top."""
    return dict(os.environ, CUDA_VISIBLE_DEVICES="", **extra)


def free_port():
    """A loopback port that no socket holds now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_was_taken(done):
    return any(text in (done.stdout + done.stderr).lower() for text in PORT_TAKEN)


def run_distributed(nproc, argv, env, timeout, cwd=REPO):
    """`python -m torch.distributed.run` of argv (a script and its arguments) in nproc processes
    of one node, meeting on a free loopback port: the CompletedProcess (text, output captured).
    The port is free when picked, but another program may take it before the launcher binds it;
    such a launch fails in setting up, not in what it runs, so it is launched again on another
    port, up to LAUNCH_ATTEMPTS times. Any other failure is returned at once."""
    for _ in range(LAUNCH_ATTEMPTS):
        # is_host=1: this launcher holds the rendezvous store, and a port found taken is an error
        # (EADDRINUSE) rather than a connection to whatever listens there.
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={nproc}",
               "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}", "--rdzv_conf=is_host=1",
               f"--rdzv_id={uuid.uuid4()}", *argv]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
        if done.returncode == 0 or not port_was_taken(done):
            return done
    return done


def finish(process, timeout):
    """process.communicate(timeout=timeout); a process still running then is killed (and reaped)
    before subprocess.TimeoutExpired goes on."""
    try:
        return process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate(timeout=30)
        raise


class LineReader:
    """Reads a process's text stream on a thread, so that waiting for a line has a deadline."""

    def __init__(self, stream):
        self.lines, self.ended = [], False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream):
        for line in stream:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self.ended = True
            self._changed.notify_all()

    def wait_for(self, predicate, timeout):
        """The first line for which predicate(line) is true; None if the stream ends, or `timeout`
        seconds pass, before one comes."""
        def found():
            return next((line for line in self.lines if predicate(line)), None) or self.ended
        with self._changed:
            self._changed.wait_for(found, timeout)
            return next((line for line in self.lines if predicate(line)), None)

    def text(self, timeout):
        """Everything the stream held, once it has ended (within `timeout` seconds)."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the stream did not end within {timeout} s")
        return "".join(self.lines)


def run_nodes(nnodes, argv, env, timeout, cwd=REPO):
    """`python -m torch.distributed.run --nnodes=nnodes --nproc_per_node=1` of argv started
    nnodes times at once on this machine, as the agents of nnodes machines would be, meeting at a
    c10d rendezvous on a free loopback port that the first agent hosts: their CompletedProcesses.
    Launched again on another port, up to LAUNCH_ATTEMPTS times, when the port was taken."""
    for _ in range(LAUNCH_ATTEMPTS):
        endpoint, run_id = f"127.0.0.1:{free_port()}", str(uuid.uuid4())
        agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
                                    "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}",
                                    f"--rdzv_id={run_id}", f"--rdzv_conf=is_host={int(node == 0)}", *argv],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd)
                  for node in range(nnodes)]
        try:
            outputs = [finish(agent, timeout) for agent in agents]
        finally:
            for agent in agents:
                if agent.poll() is None:
                    agent.kill()
                    agent.communicate(timeout=30)
        done = [subprocess.CompletedProcess(agent.args, agent.returncode, out, err)
                for agent, (out, err) in zip(agents, outputs)]
        if all(d.returncode == 0 for d in done) or not any(port_was_taken(d) for d in done):
            return done
    return done
