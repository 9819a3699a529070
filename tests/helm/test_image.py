"""The image: the Dockerfile installs every Debian package that Mooncake's engine.so (and the
libraries bundled with it) needs, and scripts/image_check.sh builds the Dockerfile as it is
meant to be built (same base arg, extras, torch version and wheel folder).

The NEEDED entries are read from the installed wheel with `readelf -d`; libraries the wheel
bundles are followed recursively, the rest must map to a Debian package below."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = (REPO / "Dockerfile").read_text()
SCRIPT = (REPO / "scripts" / "image_check.sh").read_text()

# soname -> Debian package (bookworm; Ubuntu 24.04 resolves libcurl4 to libcurl4t64).
DEBIAN_PACKAGE = {
    "libibverbs.so.1": "libibverbs1",
    "libnuma.so.1": "libnuma1",
    "libcurl.so.4": "libcurl4",
    "libstdc++.so.6": "libstdc++6",
    "libgcc_s.so.1": "libgcc-s1",
    **{lib: "libc6" for lib in ("libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0",
                                "libresolv.so.2", "librt.so.1", "ld-linux-x86-64.so.2")},
}
# In every Debian/Ubuntu base image (apt and Python need them), so never missing.
IN_EVERY_BASE = {"libc6", "libstdc++6", "libgcc-s1"}
# Not a library, but needed: the NIC drivers libibverbs loads (no RDMA device without them).
ALSO_REQUIRED = {"ibverbs-providers"}


def _needed(path: Path) -> list[str]:
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True,
                         check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def mooncake_sonames() -> set[str]:
    """Sonames engine.so needs from the system, following the libraries its wheel bundles."""
    import mooncake

    pkg = Path(mooncake.__file__).parent
    bundled = {p.name: p for d in (pkg, pkg.parent / "mooncake_transfer_engine_non_cuda.libs")
               if d.is_dir() for p in d.glob("*.so*")}
    todo, seen, system = [pkg / "engine.so"], set(), set()
    while todo:
        lib = todo.pop()
        if lib in seen:
            continue
        seen.add(lib)
        for name in _needed(lib):
            if name in bundled:
                todo.append(bundled[name])
            else:
                system.add(name)
    return system


def apt_installed() -> set[str]:
    """Every package named in an `apt-get install` of the Dockerfile."""
    text = DOCKERFILE.replace("\\\n", " ")
    pkgs = set()
    for m in re.finditer(r"apt-get install ([^&;]*)", text):
        pkgs |= {w for w in m.group(1).split() if not w.startswith("-")}
    return pkgs


def test_dockerfile_installs_every_library_mooncake_needs():
    sonames = mooncake_sonames()
    assert {"libibverbs.so.1", "libnuma.so.1", "libcurl.so.4"} <= sonames  # sanity
    unknown = sonames - DEBIAN_PACKAGE.keys()
    assert not unknown, f"engine.so needs {unknown}: add them to DEBIAN_PACKAGE and the Dockerfile"
    wanted = {DEBIAN_PACKAGE[s] for s in sonames} - IN_EVERY_BASE | ALSO_REQUIRED
    missing = wanted - apt_installed()
    assert not missing, f"the Dockerfile does not install {missing}"


def test_the_package_map_matches_this_machine():
    """Where dpkg knows a library (a Debian host with it installed), the map names the
    package that really ships it."""
    checked = 0
    for soname in ("libibverbs.so.1", "libnuma.so.1", "libcurl.so.4") * bool(
            shutil.which("dpkg")):
        out = subprocess.run(["dpkg", "-S", soname], capture_output=True, text=True)
        if out.returncode == 0:
            owners = {line.split(":")[0] for line in out.stdout.splitlines()}
            assert DEBIAN_PACKAGE[soname] in owners, (soname, owners)
            checked += 1
    # Mooncake loads on any machine running these tests, so dpkg knows all three there.
    assert checked == 3 or not shutil.which("dpkg")


def _dockerfile_default(arg: str) -> str:
    m = re.search(rf"^ARG {arg}=(.*)$", DOCKERFILE, re.M)
    assert m, f"the Dockerfile has no ARG {arg}"
    return m.group(1).strip()


def _script_var(name: str) -> str:
    m = re.search(rf"^{name}=(\S+)$", SCRIPT, re.M)
    assert m, f"image_check.sh sets no {name}"
    return m.group(1)


def test_image_check_script_and_dockerfile_agree():
    # The base goes in through the Dockerfile's build arg, the one FROM uses.
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", DOCKERFILE, re.M)
    assert '--build-arg BASE_IMAGE="$BASE_TAG"' in SCRIPT
    assert "# syntax=" not in DOCKERFILE  # a syntax line makes the build pull a frontend
    # Same extras (the mooncake backend is what the check runs) and torch version.
    assert _script_var("EXTRAS") == _dockerfile_default("EXTRAS") == "mooncake"
    assert '--build-arg EXTRAS="$EXTRAS"' in SCRIPT
    assert _script_var("TORCH_VERSION") == _dockerfile_default("TORCH_VERSION")
    assert '--build-arg TORCH_VERSION="$TORCH_VERSION"' in SCRIPT
    # The wheel folder the script fills is the one the Dockerfile copies and installs from.
    assert "COPY docker/wheels /tmp/wheels" in DOCKERFILE
    assert '"$CTX/docker/wheels/"' in SCRIPT
    assert (REPO / "docker" / "wheels").is_dir()
    ignored = [ln.strip().strip("/") for ln in (REPO / ".dockerignore").read_text().splitlines()]
    assert "docker" not in ignored and "docker/wheels" not in ignored
    # And the run inside the image uses that backend.
    assert "--transfer-backend mooncake" in SCRIPT


def test_image_check_script_is_valid_bash():
    res = subprocess.run(["bash", "-n", str(REPO / "scripts" / "image_check.sh")],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def _recipes_in(text: str) -> list[str]:
    return [m.group(0).replace("\\\n", " ")
            for m in re.finditer(r"docker build -t pdserve-cuda\S*(?:[^\n]*\\\n)*[^\n]*", text)]


def _gpu_recipes() -> list[str]:
    """The GPU `docker build` commands of the docs (README.md, docs/*.md; the recipe lives in
    docs/deploy.md) and of the Dockerfile's header."""
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    header = "\n".join(ln.lstrip("# ") for ln in DOCKERFILE.splitlines() if ln.startswith("#"))
    in_header = _recipes_in(header)
    in_deploy = _recipes_in((REPO / "docs" / "deploy.md").read_text())
    assert len(in_header) == 1, f"the Dockerfile's header has {len(in_header)} GPU recipes"
    assert len(in_deploy) >= 1, "docs/deploy.md has no GPU `docker build` recipe"
    return in_header + [r for path in docs for r in _recipes_in(path.read_text())]


def test_gpu_image_recipes_pick_the_mooncake_build_of_their_torch():
    from kv_transfer.compat import image_refusal

    recipes = _gpu_recipes()
    assert len(recipes) >= 2, recipes
    for cmd in recipes:
        cu = re.search(r"whl/cu(\d+)", cmd).group(1)  # cu128 -> CUDA 12.8
        extras = re.search(r"--build-arg EXTRAS=(\S+)", cmd)
        assert extras, f"a GPU recipe without EXTRAS installs the non-CUDA Mooncake: {cmd}"
        assert image_refusal(extras.group(1), f"{cu[:-1]}.{cu[-1]}") is None, cmd
    # The chart's GPU values use that image.
    import yaml

    rdma = yaml.safe_load((REPO / "helm" / "ci-values" / "rdma.yaml").read_text())
    assert rdma["engine"]["device"] == "cuda"
    assert rdma["image"]["repository"].endswith("/pdserve-cuda")


def test_image_refusal_catches_each_mismatch():
    from kv_transfer.compat import image_refusal

    assert "non-cuda" in image_refusal("mooncake", "12.8")  # the old GPU recipe
    assert "cuda12" in image_refusal("cuda", "12.8") and "EXTRAS=cuda12" in image_refusal(
        "cuda", "12.8")
    assert image_refusal("cuda", "13.0") is None and image_refusal("cuda12", "12.4") is None
    assert image_refusal("mooncake", None) is None
    assert "CPU torch" in image_refusal("cuda12", None)
