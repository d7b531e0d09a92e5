"""psd's Python package installed with pip (python/pyproject.toml) into a fresh virtual
environment, without the network, then a worker script outside the checkout trains through it
with a real psd: what docs/usage.md's "Installing the Python package" says."""
import os
import shutil
import subprocess
import sys

from conftest import HERE

ROOT = os.path.dirname(os.path.dirname(HERE))


def test_pip_installs_the_package_and_a_script_outside_the_checkout_trains_with_it(run, tmp_path):
    src = tmp_path / "src"  # a copy: pip builds in the directory it is given
    shutil.copytree(os.path.join(ROOT, "python", "psd"), src / "psd", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(ROOT, "python", "pyproject.toml"), src)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the checkout's package out of sight
    env["PSD_WORKER_LIB"] = os.path.join(ROOT, "build", "libpsworker.so.3")  # the library where the build put it
    venv = tmp_path / "venv"
    # Debian's torch (python3-torch) through the system's site packages; pip's own setuptools
    # and wheel build it (--no-build-isolation): nothing is downloaded (--no-index)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    r = subprocess.run([py, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-index", "--no-deps",
                        str(src)], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    site = subprocess.run([py, "-c", "import psd, os; print(os.path.dirname(psd.__file__))"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, check=True).stdout.strip()
    assert site.startswith(str(venv)), site
    have = {f for f in os.listdir(os.path.join(ROOT, "python", "psd")) if f.endswith(".py")}
    assert have <= set(os.listdir(site)), "not installed: %s" % sorted(have - set(os.listdir(site)))
    # a worker script of the user's, outside the checkout
    script = tmp_path / "train.py"
    shutil.copy(os.path.join(HERE, "mlp_worker.py"), script)
    r0 = run(1, extra=("--set", "run.epochs=1"))
    w = subprocess.run([py, str(script), r0.ep], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert w.returncode == 0, w.stdout + w.stderr
    assert r0.psd.wait(timeout=60) == 0, r0.psd_log()
    assert r0.metrics()[-1]["train_samples"] == 1800
