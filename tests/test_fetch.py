"""`dbs-mpi data fetch` against an HTTP server on 127.0.0.1 (a thread of this test
process, serving files the tests write), and `dbs-mpi data check`. The published
checksums and record counts are replaced by the small files' own; every network
operation has a timeout of a few seconds."""
import functools
import hashlib
import http.server
import io
import socket
import tarfile
import threading
import time

import pytest

from conftest import run_cli
from dbs_mpi.tools import data
from dbs_mpi.tools.data import DataError, data_main, load_dataset, unpack
from test_data import cifar_arrays, write_cifar, write_idx_dataset

pytestmark = pytest.mark.timeout(120)
TIMEOUT = "5"   # seconds, --timeout of every fetch here


def md5(path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        self.server.requests.append(self.path)


@pytest.fixture
def mirror(tmp_path):
    """(URL, folder): an HTTP server on 127.0.0.1 serving `folder`; its `requests`
    attribute lists the paths asked for."""
    root = tmp_path / "mirror"
    root.mkdir(exist_ok=True)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(root)))
    server.requests = []
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", root, server
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


@pytest.fixture
def small_mnist(tmp_path, monkeypatch):
    """MNIST-format files (20 train, 10 test) in mirror/mnist/, published as official."""
    folder = tmp_path / "mirror" / "mnist"
    write_idx_dataset(folder)
    sums = {f: md5(folder / f) for f in data.DOWNLOADS["mnist"]}
    monkeypatch.setitem(data.DOWNLOADS, "mnist", sums)
    monkeypatch.setitem(data.KNOWN_MD5, "mnist", {f: (m,) for f, m in sums.items()})
    monkeypatch.setitem(data.SPLIT_SIZES, "mnist", {"train": 20, "test": 10})
    return folder


def cifar_archive(path, members):
    """A tar.gz of {member name: bytes}."""
    with tarfile.open(path, "w:gz") as tar:
        for name, content in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))


@pytest.fixture
def small_cifar(tmp_path, monkeypatch):
    """A CIFAR-10 python-version archive (4 images per batch) in mirror/cifar10/,
    published as official, like the real one: the folder and its batches."""
    staging = tmp_path / "staging" / "cifar-10-batches-py"
    write_cifar(staging, cifar_arrays())
    (staging / "batches.meta").write_bytes(b"meta")
    folder = tmp_path / "mirror" / "cifar10"
    folder.mkdir(parents=True)
    archive = folder / "cifar-10-python.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(staging, arcname="cifar-10-batches-py")
    monkeypatch.setitem(data.DOWNLOADS, "cifar10", {archive.name: md5(archive)})
    monkeypatch.setitem(data.KNOWN_MD5, "cifar10", {p.name: (md5(p),) for p in staging.iterdir()})
    monkeypatch.setitem(data.SPLIT_SIZES, "cifar10", {"train": 20, "test": 4})
    return archive


def error_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dbs-mpi: error: "), err
    return err[0]


# --- fetch ---------------------------------------------------------------------------------


def test_fetch_mnist_downloads_verifies_and_is_idempotent(tmp_path, mirror, small_mnist, capsys):
    url, _, server = mirror
    dest = tmp_path / "data"
    assert data_main(["fetch", "mnist", "--data-dir", str(dest), "--mirror", url, "--timeout", TIMEOUT]) == 0
    out = capsys.readouterr().out
    assert "MD5 ok" in out and "mnist: ok (20 train + 10 test samples" in out
    assert sorted(p.name for p in (dest / "mnist").iterdir()) == sorted(data.DOWNLOADS["mnist"])   # no .part left
    assert sorted(server.requests) == sorted(f"/mnist/{f}" for f in data.DOWNLOADS["mnist"])
    assert load_dataset("mnist", "test", dest).x.shape == (10, 1, 28, 28)
    assert data_main(["fetch", "mnist", "--data-dir", str(dest), "--mirror", url, "--timeout", TIMEOUT]) == 0
    assert "already present" in capsys.readouterr().out and len(server.requests) == 4


def test_fetch_replaces_only_bad_files_and_takes_the_mirror_from_the_environment(tmp_path, mirror, small_mnist,
                                                                                  monkeypatch):
    url, _, server = mirror
    dest = tmp_path / "data"
    write_idx_dataset(dest / "mnist")
    for f in ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
        (dest / "mnist" / f).write_bytes((small_mnist / f).read_bytes())
    (dest / "mnist" / "t10k-images-idx3-ubyte.gz").write_bytes(b"\x1f\x8b broken")
    monkeypatch.setenv("DBS_MPI_MIRROR", url + "/")
    assert data_main(["fetch", "mnist", "--data-dir", str(dest), "--timeout", TIMEOUT]) == 0
    assert server.requests == ["/mnist/t10k-images-idx3-ubyte.gz"]
    assert md5(dest / "mnist" / "t10k-images-idx3-ubyte.gz") == data.DOWNLOADS["mnist"]["t10k-images-idx3-ubyte.gz"]


def test_fetch_wrong_checksum_keeps_nothing(tmp_path, mirror, small_mnist, monkeypatch, capsys):
    url, _, _ = mirror
    monkeypatch.setitem(data.DOWNLOADS["mnist"], "train-images-idx3-ubyte.gz", "0" * 32)
    dest = tmp_path / "data"
    assert data_main(["fetch", "mnist", "--data-dir", str(dest), "--mirror", url, "--timeout", TIMEOUT]) == 2
    line = error_line(capsys)
    assert f"{url}/mnist/train-images-idx3-ubyte.gz: MD5" in line and "is not the published 000" in line
    assert f"into {dest / 'mnist'}" in line and "t10k-labels-idx1-ubyte.gz" in line
    assert list((dest / "mnist").iterdir()) == []                   # neither the file nor a partial one


def test_fetch_404_says_which_files_to_put_where(tmp_path, mirror, small_mnist, capsys):
    url, _, _ = mirror
    (small_mnist / "t10k-labels-idx1-ubyte.gz").unlink()
    dest = tmp_path / "data"
    assert data_main(["fetch", "mnist", "--data-dir", str(dest), "--mirror", url, "--timeout", TIMEOUT]) == 2
    line = error_line(capsys)
    assert "t10k-labels-idx1-ubyte.gz: HTTP 404" in line
    assert "Download failed: put train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz, " \
           f"t10k-labels-idx1-ubyte.gz (from https://ossci-datasets.s3.amazonaws.com/mnist/) into {dest / 'mnist'}" \
           in line
    assert not (dest / "mnist" / "t10k-labels-idx1-ubyte.gz").exists()


def test_fetch_times_out_on_a_silent_server(tmp_path, capsys):
    with socket.socket() as silent:              # accepts connections (backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        start = time.monotonic()
        rc = data_main(["fetch", "mnist", "--data-dir", str(tmp_path), "--mirror", url, "--timeout", "0.5"])
    assert rc == 2 and time.monotonic() - start < 10
    assert "timed out" in error_line(capsys)


def test_fetch_cifar10_unpacks_the_archive(tmp_path, mirror, small_cifar, capsys):
    url, _, server = mirror
    dest = tmp_path / "data"
    assert data_main(["fetch", "cifar10", "--data-dir", str(dest), "--mirror", url, "--timeout", TIMEOUT]) == 0
    assert server.requests == ["/cifar10/cifar-10-python.tar.gz"]
    assert "cifar10: ok (20 train + 4 test samples" in capsys.readouterr().out
    assert sorted(p.name for p in (dest / "cifar10").iterdir()) == ["cifar-10-batches-py"]   # archive removed
    train = load_dataset("cifar10", "train", dest)
    assert train.x.shape == (20, 3, 32, 32)


def test_fetch_cifar10_corrupt_archive(tmp_path, mirror, small_cifar, monkeypatch, capsys):
    url, _, _ = mirror
    small_cifar.write_bytes(small_cifar.read_bytes()[:200])
    monkeypatch.setitem(data.DOWNLOADS, "cifar10", {small_cifar.name: md5(small_cifar)})
    dest = tmp_path / "data"
    assert data_main(["fetch", "cifar10", "--data-dir", str(dest), "--mirror", url, "--timeout", TIMEOUT]) == 2
    line = error_line(capsys)
    assert "cifar-10-python.tar.gz: corrupt or truncated archive" in line and "and unpack it there" in line
    assert not (dest / "cifar10" / "cifar-10-batches-py").exists()


@pytest.mark.parametrize("member", ["../evil", "/tmp/evil", "cifar-10-batches-py/../../evil", "other/evil",
                                    "symlink", "hardlink", "device"])
def test_unpack_refuses_unsafe_members(tmp_path, member):
    archive = tmp_path / "a.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        good = tarfile.TarInfo("cifar-10-batches-py/data_batch_1")
        good.size = 3
        tar.addfile(good, io.BytesIO(b"abc"))
        info = tarfile.TarInfo(member if "/" in member or member.startswith(".") else f"cifar-10-batches-py/{member}")
        if member == "symlink":
            info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        elif member == "hardlink":
            info.type, info.linkname = tarfile.LNKTYPE, "cifar-10-batches-py/data_batch_1"
        elif member == "device":
            info.type = tarfile.CHRTYPE
        else:
            info.size = 4
        tar.addfile(info, io.BytesIO(b"evil") if info.isfile() else None)
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(DataError, match="unsafe or unexpected member") as exc:
        unpack(archive, dest, "cifar-10-batches-py")
    assert str(archive) in str(exc.value)
    assert list(dest.iterdir()) == [] and not (tmp_path / "evil").exists()


def test_unpack_replaces_an_older_folder(tmp_path):
    archive = tmp_path / "a.tar.gz"
    cifar_archive(archive, {"cifar-10-batches-py/test_batch": b"new"})
    old = tmp_path / "cifar-10-batches-py"
    old.mkdir()
    (old / "stale").write_bytes(b"old")
    assert unpack(archive, tmp_path, "cifar-10-batches-py") == old
    assert [p.name for p in old.iterdir()] == ["test_batch"] and (old / "test_batch").read_bytes() == b"new"


# --- check ---------------------------------------------------------------------------------


def test_check_good_and_bad(tmp_path, small_mnist, capsys):
    dest = tmp_path / "data"
    (dest / "mnist").mkdir(parents=True)
    for f in data.DOWNLOADS["mnist"]:
        (dest / "mnist" / f).write_bytes((small_mnist / f).read_bytes())
    assert data_main(["check", "mnist", "--data-dir", str(dest)]) == 0
    line, = capsys.readouterr().out.splitlines()
    assert line.split()[:2] == ["mnist", "ok"] and "4 of 4 files match published MD5s" in line

    write_idx_dataset(dest / "mnist", seed=1)                     # valid files, but not the published ones
    assert data_main(["check", "mnist", "--data-dir", str(dest)]) == 1
    line, = capsys.readouterr().out.splitlines()
    assert line.split()[:2] == ["mnist", "bad"] and "is not the published" in line

    write_idx_dataset(dest / "mnist", n_train=19)                 # a sample short
    assert data_main(["check", "mnist", "--data-dir", str(dest)]) == 1
    assert "19 train samples, the official files have 20" in capsys.readouterr().out


def test_check_cifar_binary_counts_records(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(data.SPLIT_SIZES, "cifar10", {"train": 20, "test": 4})
    write_cifar(tmp_path / "cifar-10-batches-bin", cifar_arrays(), binary=True)
    assert data_main(["check", "cifar10", "--data-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "cifar10" in out and " ok " in out and "0 of 6 files match published MD5s, the others' records" in out
    (tmp_path / "cifar-10-batches-bin" / "data_batch_2.bin").write_bytes(b"\0" * 100)
    assert data_main(["check", "cifar10", "--data-dir", str(tmp_path)]) == 1
    assert "bad" in capsys.readouterr().out


def test_check_and_fetch_from_the_command_line(tmp_path):
    """As users run it: one line per dataset, status 1 when missing; a user's error is
    one line and status 2, no traceback."""
    proc = run_cli(["data", "check", "--data-dir", str(tmp_path)])
    assert proc.returncode == 1, proc.stderr
    status = dict(line.split()[:2] for line in proc.stdout.splitlines())
    assert status.pop("fashion-mnist") in ("missing", "ok")     # ok where Debian's package is installed
    assert status == {"mnist": "missing", "cifar10": "missing"}
    proc = run_cli(["data", "fetch", "cifar100", "--data-dir", str(tmp_path)])
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "dbs-mpi: error: argument NAME: unknown dataset 'cifar100' (choose from mnist, fashion-mnist, cifar10)"]
    proc = run_cli(["data", "fetch", "mnist", "--data-dir", str(tmp_path), "--mirror", "http://127.0.0.1:9",
                    "--timeout", "2"])
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("dbs-mpi: error: mnist: http://127.0.0.1:9/mnist/train-images-idx3-ubyte.gz")
