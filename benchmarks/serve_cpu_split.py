"""Where a served run's CPU goes: starts `pagellm serve --dtype auto --no-enable-prefix-caching` (extra serve
options after `--`), runs `pagellm bench serve --url` against it with the serving benchmark's workload (64
requests at once, prompts 128-384, outputs 64-192), and prints the CPU seconds of the API process, the engine
core process (from /proc, over the run) and the bench client, next to the run's duration and throughput. The
twenty-eighth session's figures (benchmarks/NOTES.md) come from this, run alone on the machine:

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python benchmarks/serve_cpu_split.py [-- SERVE OPTIONS]

Its offline counterpart is benchmarks/serve_workload_offline.py (the same workload in one LLM.generate).
"""

import os
import re
import resource
import socket
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
PY = sys.executable


def cpu_s(pid: int) -> float:
    """utime + stime of a live process, in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(x) for x in f.read().split()]


def launch(cmd_for_port, env: dict | None = None, ready_s: float = 120.0) -> tuple[subprocess.Popen, str]:
    """cmd_for_port(port) started on a free local port, once its /health answers: the process and its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(cmd_for_port(port), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    for _ in range(int(ready_s * 2)):
        try:
            if urllib.request.urlopen(url + "/health", timeout=1).status == 200:
                return server, url
        except OSError:
            time.sleep(0.5)
    server.kill()
    raise SystemExit(f"the server did not become ready in {ready_s:g} s")


def start_server(extra: list[str], env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """`pagellm serve --dtype auto --no-enable-prefix-caching` (plus extra options) on a free local port, once its
    /health answers: the process and its URL."""
    return launch(lambda port: [PY, "-m", "pagellm.cli", "serve", "--dtype", "auto", "--no-enable-prefix-caching",
                                "--port", str(port), *extra], env)


def run_workload(url: str, bench_args: tuple[str, ...] | list[str] = ()) -> str:
    """`pagellm bench serve --url` with the serving workload (64 requests at once, prompts 128-384, outputs
    64-192): its printed report."""
    return subprocess.run([PY, "-m", "pagellm.cli", "bench", "serve", "--url", url, "--num-prompts", "64",
                           "--input-len", "256", "--output-len", "128", "--range-ratio", "0.5", *bench_args],
                          capture_output=True, text=True, timeout=600).stdout


def main() -> None:
    extra = sys.argv[sys.argv.index("--") + 1:] if "--" in sys.argv else []
    server, url = start_server(extra)
    try:
        procs = {"API process": server.pid, "engine core": children(server.pid)[0]}
        before = {name: cpu_s(pid) for name, pid in procs.items()}
        client0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        out = run_workload(url)
        client1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        used = {name: cpu_s(pid) - before[name] for name, pid in procs.items()}
        steps = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    finally:
        server.terminate()
        server.wait(timeout=60)
    for key in ("Benchmark duration", "Output token throughput"):
        print(next((line for line in out.splitlines() if line.startswith(key)), f"{key}: not found"))
    for name, s in used.items():
        print(f"{name:<12} {s:6.2f} CPU-s")
    print(f"{'bench client':<12} {client1.ru_utime + client1.ru_stime - client0.ru_utime - client0.ru_stime:6.2f} "
          "CPU-s (start-up included)")
    print(next((line for line in out.splitlines() if line.startswith("client CPU during the run")),
               "client CPU during the run: not printed"))
    m = re.search(r"^pagellm:iteration_tokens_total_count\{[^}]*\} (\S+)", steps, re.M)
    print(f"engine steps {m.group(1) if m else 'not found'}")


if __name__ == "__main__":
    main()
