"""Installing: the requirements split so that training needs only requirements/train.txt (each
package a module imports pinned in the file of what that module is for), the whole set still
resolving from requirements.txt; the Python version stated in the README and checked at the start
of train_gpt.py and run.sh, each with one line; the README's CPU wheel; the Dockerfile; the LICENSE."""
import ast
import importlib.metadata
import os
import pathlib
import re
import stat
import subprocess
import sys

import pytest
from launch import cpu_env
from packaging.requirements import Requirement
from tiny_runs import REPO

sys.path.insert(0, REPO)
import train_gpt as tg  # noqa: E402

ROOT = pathlib.Path(REPO)
PIN = re.compile(r"^([A-Za-z0-9_.-]+)==(\S+)$")
# What each requirements file is for: the project files whose imports it must cover (with those of
# the files it includes), as globs from the repository root.
PURPOSES = {
    "train.txt": ["train_gpt.py", "kernels.py", "optim.py", "machinery/*.py", "evaluation/evaluate.py", "data/*.py",
                  "records/logfile.py"],
    "eval.txt": ["evaluation/downstream.py"],
    "records.txt": ["records/*.py"],
    "dev.txt": ["tests/*.py", "tests/helpers/*.py", "bench/*.py"],
}
OLDER_PYTHON = (3, 10, 12)         # a Python the pins do not install on


def normalized(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(name, seen=()):
    """{distribution: version} of requirements/<name> with the files it includes (-r)."""
    out = {}
    for line in (ROOT / "requirements" / name).read_text().splitlines():
        line = line.split("#")[0].strip()
        if line.startswith("-r "):
            out |= pins(line[3:].strip(), (*seen, name))
        elif line:
            m = PIN.match(line)
            assert m, f"requirements/{name}: {line!r} is not a pin (name==version)"
            out[normalized(m[1])] = m[2]
    return out


def optional_imports(tree):
    """The import statements of `tree` inside a try whose handler catches ImportError: a module the
    file works without (kernels.py's triton on a CPU-only install)."""
    optional = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(isinstance(h.type, ast.Name) and h.type.id in ("ImportError",
                                                                                          "ModuleNotFoundError")
                                             for h in node.handlers):
            optional |= {id(n) for statement in node.body for n in ast.walk(statement)}
    return optional


def imported_distributions(patterns):
    """The distributions that the files matching `patterns` import (their top-level third-party
    modules, anywhere in the file, but where an ImportError is caught), by importlib.metadata."""
    providers = importlib.metadata.packages_distributions()
    local = {p.stem for p in ROOT.glob("*.py")} | {"data", "records", "machinery", "evaluation", "tests", "bench",
                                                   "launch", "tiny_runs"}
    names = set()
    for pattern in patterns:
        for path in ROOT.glob(pattern):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            optional = optional_imports(tree)
            for node in ast.walk(tree):
                if id(node) in optional:
                    continue
                if isinstance(node, ast.Import):
                    names |= {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    names.add(node.module.split(".")[0])
    local |= {p.stem for pattern in ("tests/*.py", "tests/helpers/*.py", "bench/*.py") for p in ROOT.glob(pattern)}
    third_party = {n for n in names if n not in sys.stdlib_module_names and n not in local}
    missing = sorted(n for n in third_party if n not in providers)
    assert not missing, f"modules of no installed distribution: {missing}"
    return {normalized(d) for n in third_party for d in providers[n]}


def installed_with(distributions):
    """The distributions that installing `distributions` installs: they and, recursively, what
    their metadata requires on this Python (extras aside)."""
    todo, seen = list(distributions), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for text in importlib.metadata.requires(name) or ():
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(normalized(requirement.name))
    return seen


# What CUDA torch installs with itself (it pins triton), and only a GPU run imports: the kernel
# choice's timer (machinery/kernel_choice.py) on CUDA; a CPU-only install runs without it.
WITH_CUDA_TORCH = {"triton"}


@pytest.mark.parametrize("name", PURPOSES)
def test_each_requirements_file_installs_what_its_part_imports(name):
    assert imported_distributions(PURPOSES[name]) - WITH_CUDA_TORCH <= installed_with(pins(name))


def test_training_alone_installs_none_of_the_extras():
    train = set(pins("train.txt"))
    assert not train & {"lm-eval", "pytest", "scipy", "matplotlib", "safetensors", "triton"}
    assert pins("dev.txt") == {**pins("train.txt"), **pins("eval.txt"), **pins("records.txt"), **pins("dev.txt")}


def test_requirements_txt_is_every_file_and_resolves_here():
    """requirements.txt includes the whole set, and pip resolves it against this machine's
    packages without an index (the README's first command, offline)."""
    lines = [line for line in (ROOT / "requirements.txt").read_text().splitlines() if line and line[0] != "#"]
    assert lines == ["-r requirements/dev.txt"]
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "-r", "requirements.txt"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Would install" not in done.stdout     # every pin is what is installed


def test_the_readme_states_the_python_version_and_the_cpu_wheel():
    readme = (ROOT / "README.md").read_text()
    assert f"Python {tg.MIN_PYTHON[0]}.{tg.MIN_PYTHON[1]} or newer" in readme
    torch = pins("train.txt")["torch"]
    assert f"pip install torch=={torch} --index-url https://download.pytorch.org/whl/cpu" in readme
    assert "`requirements/train.txt`" in readme or "requirements/train.txt" in readme


CPU_WHEEL_INDEX = "https://download.pytorch.org/whl/cpu"
# Distributions that are CUDA, or that only a GPU uses: what a CPU-only install must not pull.
GPU_ONLY = re.compile(r"nvidia-.*|cuda-.*|cupy.*|triton|pytorch-triton.*")


def readme_install_commands():
    """The pip commands of the README's first code block, in order, each as its arguments."""
    block = (ROOT / "README.md").read_text().split("```bash\n")[1].split("```")[0]
    commands = []
    for line in block.splitlines():
        for part in line.split("#")[0].split("&&"):
            words = part.split()
            if words[:2] == ["pip", "install"]:
                commands.append(words[2:])
    return commands


def test_a_cpu_only_install_by_the_readmes_first_commands_pulls_no_cuda_package():
    """The README's first command installs torch's CPU wheel at requirements/train.txt's pin; the
    next installs requirements/train.txt, which that wheel satisfies (its pin has no local version,
    so pip keeps torch 2.13.0+cpu) and whose other pins, with what they require, hold no CUDA or
    GPU-only package; no requirements file names another index. On a machine with the CPU wheel,
    pip resolves the file offline with nothing to install."""
    from packaging.specifiers import SpecifierSet
    first, second = readme_install_commands()[:2]
    torch_pin = pins("train.txt")["torch"]
    assert first == [f"torch=={torch_pin}", "--index-url", CPU_WHEEL_INDEX]
    assert second == ["-r", "requirements/train.txt"]
    assert f"{torch_pin}+cpu" in SpecifierSet(f"=={torch_pin}")
    others = set(pins("train.txt")) - {"torch"}
    pulled = installed_with(others)
    assert not [name for name in pulled | set(pins("train.txt")) if GPU_ONLY.fullmatch(name)], pulled
    for path in (ROOT / "requirements").glob("*.txt"):
        assert not [line for line in path.read_text().splitlines() if "index-url" in line.split("#")[0]], path
    import torch
    if torch.__version__.endswith("+cpu"):
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "-r",
                               "requirements/train.txt"], cwd=REPO, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and "Would install" not in done.stdout, done.stdout + done.stderr


def test_training_on_a_cpu_runs_without_triton(shards, tmp_path):
    """With triton absent (requirements/train.txt does not pin it), a CPU run trains on the kernels'
    references and logs triton as none; a Triton kernel launched anyway says what is missing."""
    from tiny_runs import TINY, data_args
    blocked = "import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None; "
    run = (blocked + "import runpy; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", run, "train_gpt.py", "--preset", "cpu", *TINY, *data_args(shards),
                           "--num_iterations=2", f"--log_dir={tmp_path}"], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env=cpu_env(OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr
    (log,) = tmp_path.glob("*.txt")
    assert "\ntriton: none #" in log.read_text()
    launch = subprocess.run([sys.executable, "-c", blocked + "import kernels; kernels._transpose_kernel[(1,)]()"],
                            cwd=REPO, capture_output=True, text=True, timeout=300, env=cpu_env())
    assert launch.returncode != 0 and "the Triton kernels need the triton package, which is not installed" in launch.stderr


def test_each_test_has_a_time_limit(pytestconfig):
    """tests/pytest.ini sets pytest-timeout's limit (the plugin pinned in requirements/dev.txt)."""
    assert "pytest-timeout" in pins("dev.txt") and int(pytestconfig.getini("timeout")) > 0


def test_train_gpt_on_an_older_python_ends_with_one_line():
    code = (f"import runpy, sys; sys.version_info = {OLDER_PYTHON + ('final', 0)}; sys.argv = ['train_gpt.py']; "
            f"runpy.run_path('train_gpt.py', run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=cpu_env())
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr.splitlines() == [
        f"error: train_gpt.py needs Python 3.11 or newer (the pinned numpy and scipy have no wheels for older "
        f"ones); this is Python 3.10.12 at {sys.executable}: run it with a newer one (./run.sh takes "
        f"PYTHON=python3.11)"]


def test_run_sh_with_an_older_python_ends_with_one_line(tmp_path):
    python = tmp_path / "python3.10"
    python.write_text(f"#!/bin/bash\n# a Python that says it is 3.10.12\n"
                      f"if [ \"$1\" = -c ]; then exec {sys.executable} -c \"import sys; sys.version_info = "
                      f"{OLDER_PYTHON + ('final', 0)}; exec(sys.argv[1])\" \"$2\"; fi\nexec {sys.executable} \"$@\"\n")
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    done = subprocess.run(["./run.sh"], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=cpu_env(PYTHON=str(python)))
    assert done.returncode == 2 and done.stderr.splitlines() == [
        f"run.sh: Python 3.11 or newer is needed; {python} is Python 3.10.12: set PYTHON to a newer one, e.g. "
        f"PYTHON=python3.11 ./run.sh"], done


def test_the_dockerfile_builds_the_gpu_image_and_runs_the_readmes_command():
    """A Python the pins install on; torch and triton at requirements.txt's pins (read from
    requirements/ when it builds), every other pin; its entry checks the driver; ./run.sh."""
    text = (ROOT / "Dockerfile").read_text()
    base = re.search(r"^FROM python:(\d+)\.(\d+)-slim$", text, re.M)
    assert base and tuple(map(int, base.groups())) >= tg.MIN_PYTHON
    assert not re.search(r"^ARG (TORCH|TRITON)=", text, re.M)          # no versions of its own
    assert '"torch==$(pin torch)" "triton==$(pin triton)"' in text and "pip install -r requirements.txt" in text
    pin = re.search(r'pin\(\) \{ (.*); \}', text)[1]
    for name in ("torch", "triton"):
        done = subprocess.run(["bash", "-c", f"pin() {{ {pin}; }}; pin {name}"], cwd=REPO, capture_output=True,
                              text=True, timeout=60)
        assert done.stdout.strip() == pins("dev.txt")[name], name
    assert re.search(r"^COPY requirements/ requirements/$", text, re.M) and text.rstrip().endswith('CMD ["./run.sh"]')
    assert 'ENTRYPOINT ["./machinery/docker-entrypoint.sh"]' in text and "ARG MIN_DRIVER=580" in text
    assert "NVIDIA driver of 580 or newer" in text


@pytest.mark.parametrize("smi, code, line", [
    ("echo 535.104.05", 2, "speedrun image: the host's NVIDIA driver is 535.104.05; this image's CUDA torch needs 580 "
                           "or newer: update the driver, or build the image for CUDA 12.8"),
    ("echo 580.82.07", 0, "speedrun image: NVIDIA driver 580.82.07 (this image needs 580 or newer)"),
    (None, 0, "speedrun image: no NVIDIA GPU in the container (run it with --gpus all); running on the CPU"),
], ids=["old driver", "new driver", "no GPU"])
def test_the_images_entry_checks_the_driver_in_one_line(tmp_path, smi, code, line):
    """machinery/docker-entrypoint.sh with a stand-in nvidia-smi (or none on the PATH): one line on stderr,
    then the command runs, or (an older driver) exit code 2 without it."""
    (tmp_path / "bin").mkdir()
    if smi:
        (tmp_path / "bin" / "nvidia-smi").write_text(f"#!/bin/sh\n{smi}\n")
        (tmp_path / "bin" / "nvidia-smi").chmod(0o755)
    env = {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "SPEEDRUN_MIN_DRIVER": "580"}
    done = subprocess.run([str(ROOT / "machinery" / "docker-entrypoint.sh"), "echo", "ran"], capture_output=True, text=True,
                          timeout=60, env=env)
    assert done.returncode == code and done.stderr.splitlines()[0].startswith(line), done.stderr
    assert len(done.stderr.splitlines()) == 1 and done.stdout == ("ran\n" if code == 0 else "")


def test_the_license_is_mit():
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License\n\nCopyright (c) ")
    assert "Permission is hereby granted, free of charge, to any person obtaining a copy" in text
    assert 'THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND' in text


def project_imports(path, modules):
    """The project modules `path` imports anywhere in it (a function's lazy import and
    importlib.import_module("name") too), of `modules`."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant)):
            found.add(node.args[0].value)
    return found & modules


def import_cycle(graph):
    """A cycle of the import graph {module: modules it imports} as a list, or None."""
    state, path = {}, []

    def visit(module):
        state[module] = "open"
        path.append(module)
        for other in sorted(graph[module]):
            if state.get(other) == "open":
                return path[path.index(other):] + [other]
            if other not in state and (cycle := visit(other)):
                return cycle
        state[module] = "done"
        path.pop()
        return None
    return next((cycle for module in sorted(graph) if module not in state and (cycle := visit(module))), None)


def test_the_project_modules_import_one_another_without_a_circle():
    """The repository's modules form no import circle, lazy imports counted (the memory budget
    takes the recipe it measures instead of importing it): the training program, its machinery,
    data, records, evaluation, and the scripts of bench/ and tests/helpers/, which import their
    neighbours by bare name; a planted circle is found."""
    packages = ("*.py", "data/*.py", "records/*.py", "machinery/*.py", "evaluation/*.py")
    paths = {".".join(p.with_suffix("").relative_to(ROOT).parts): p for pattern in packages for p in ROOT.glob(pattern)}
    scripts = {p.stem: p for folder in ("bench", "tests/helpers") for p in (ROOT / folder).glob("*.py")}
    assert not set(paths) & set(scripts), "a script's bare name is also a module's"
    paths |= scripts
    graph = {name: project_imports(path, set(paths)) - {name} for name, path in paths.items()}
    assert import_cycle(graph) is None, import_cycle(graph)
    assert {"machinery.memory_budget", "records.logfile"} <= graph["train_gpt"] and "kernels" in graph["optim"]
    assert {"kernel_timings", "train_gpt"} <= graph["first_contact"]
    planted = {**graph, "kernels": graph["kernels"] | {"machinery.config"}}
    assert import_cycle(planted) == ["kernels", "machinery.config", "kernels"] or import_cycle(planted) == [
        "machinery.config", "kernels", "machinery.config"]


def test_n_auto_gives_a_worker_per_usable_core_up_to_the_cap(monkeypatch):
    import conftest
    for cores, workers in ((1, 1), (2, 2), (3, 3), (64, conftest.MAX_WORKERS)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cores: set(range(n)))
        assert conftest.pytest_xdist_auto_num_workers(None) == workers


def test_each_xdist_worker_and_what_it_starts_use_its_share_of_the_cores(monkeypatch):
    import conftest
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    assert conftest.worker_threads() is None
    for cores, workers, threads in ((2, 2, 1), (4, 2, 2), (8, 3, 2), (1, 4, 1)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cores: set(range(n)))
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(workers))
        assert conftest.worker_threads() == threads
        with pytest.MonkeyPatch.context() as env:
            conftest.clean(env)
            assert os.environ["OMP_NUM_THREADS"] == str(threads)
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT")
    with pytest.MonkeyPatch.context() as env:
        conftest.clean(env)
        assert "OMP_NUM_THREADS" not in os.environ
