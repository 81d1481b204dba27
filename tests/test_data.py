"""Dataset loaders on small files written here byte for byte in each official format
(IDX gzip and raw, CIFAR-10 python pickles and binary records), their failures on
corrupt files, and the seeded, allocation-invariant augmentation. No MPI."""
import gzip
import io
import os
import pickle
import struct

import numpy as np
import pytest
import torch

from dbs_mpi.planning import allocation, sharding
from dbs_mpi.tools.data import (DataError, MissingData, NORMALISATION, load_dataset, read_cifar_binary,
                                read_cifar_pickle, read_idx)
from dbs_mpi.training.batches import augment, augment_params

# --- writers of the official formats -----------------------------------------------


def idx_bytes(array: np.ndarray) -> bytes:
    """IDX: two zero bytes, type 0x08 (uint8), number of dimensions, big-endian sizes, data."""
    return bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()


def write_idx_dataset(folder, n_train=20, n_test=10, gz=True, seed=0):
    """The four MNIST files in `folder`; returns {split: (images, labels)}."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for split, prefix, n in (("train", "train", n_train), ("test", "t10k", n_test)):
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, n, dtype=np.uint8)
        for kind, array in (("images-idx3", images), ("labels-idx1", labels)):
            name = f"{prefix}-{kind}-ubyte"
            data = idx_bytes(array)
            if gz:
                (folder / (name + ".gz")).write_bytes(gzip.compress(data))
            else:
                (folder / name).write_bytes(data)
        out[split] = (images, labels)
    return out


class Python2Pickler(pickle._Pickler):
    """Pickles as Python 2's cPickle did at protocol 2: every string (str or bytes) as
    an 8-bit string (SHORT_BINSTRING / BINSTRING opcodes), the pixels included."""
    dispatch = dict(pickle._Pickler.dispatch)

    def save_string(self, obj):
        data = obj.encode("latin1") if isinstance(obj, str) else obj
        if len(data) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(data)]) + data)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(data)) + data)
        self.memoize(obj)

    dispatch[bytes] = save_string
    dispatch[str] = save_string


def py2_pickle(obj) -> bytes:
    out = io.BytesIO()
    Python2Pickler(out, protocol=2).dump(obj)
    return out.getvalue()


def cifar_pickle_bytes(images: np.ndarray, labels) -> bytes:
    """A batch as the official python version holds it: Python 2's pickle (protocol 2)
    of a dict with keys batch_label, labels (ints), data (uint8 (N, 3072), pickled by
    numpy.core.multiarray._reconstruct) and filenames."""
    entry = {b"batch_label": b"training batch 1 of 5", b"labels": [int(v) for v in labels],
             b"data": images.reshape(len(images), -1), b"filenames": [b"x.png"] * len(images)}
    blob = py2_pickle(entry)
    assert blob.startswith(b"\x80\x02}") and b"U\x04data" in blob
    return blob.replace(b"numpy._core.multiarray", b"numpy.core.multiarray")


def cifar_binary_bytes(images: np.ndarray, labels) -> bytes:
    """Records of 1 label byte and 3072 pixel bytes (R, G, B planes)."""
    rows = np.concatenate([np.asarray(labels, np.uint8)[:, None], images.reshape(len(images), -1)], axis=1)
    return rows.tobytes()


def cifar_arrays(seed=0, per_batch=4):
    rng = np.random.default_rng(seed)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    return {name: (rng.integers(0, 256, (per_batch, 3, 32, 32), dtype=np.uint8),
                   rng.integers(0, 10, per_batch)) for name in names}


def write_cifar(folder, arrays, binary=False):
    folder.mkdir(parents=True, exist_ok=True)
    for name, (images, labels) in arrays.items():
        if binary:
            (folder / (name + ".bin")).write_bytes(cifar_binary_bytes(images, labels))
        else:
            (folder / name).write_bytes(cifar_pickle_bytes(images, labels))


def expected_x(images: np.ndarray, name: str) -> torch.Tensor:
    mean, std = (np.array(v, np.float32).reshape(1, -1, 1, 1) for v in NORMALISATION[name])
    return torch.from_numpy((images.astype(np.float32) / 255.0 - mean) / std)


# --- IDX -----------------------------------------------------------------------------


@pytest.mark.parametrize("gz", [True, False])
@pytest.mark.parametrize("name", ["mnist", "fashion-mnist"])
def test_idx_dataset_loads_normalised(tmp_path, gz, name):
    arrays = write_idx_dataset(tmp_path / name, gz=gz)
    for split in ("train", "test"):
        ds = load_dataset(name, split, tmp_path)
        images, labels = arrays[split]
        assert ds.x.dtype == torch.float32 and ds.x.shape == (len(labels), 1, 28, 28)
        torch.testing.assert_close(ds.x, expected_x(images[:, None], name))
        assert ds.y.dtype == torch.int64 and ds.y.tolist() == labels.tolist()
        assert ds.num_classes == 10 and ds.name == name


def test_data_dir_from_environment_and_subset(tmp_path, monkeypatch):
    arrays = write_idx_dataset(tmp_path / "mnist")
    monkeypatch.setenv("DBS_MPI_DATA_DIR", str(tmp_path))
    ds = load_dataset("mnist", "train", None, subset=5)
    assert len(ds) == 5 and ds.y.tolist() == arrays["train"][1][:5].tolist()


@pytest.mark.parametrize("name", ["mnist", "fashion-mnist"])
def test_data_dir_may_be_the_root_or_the_folder_of_the_files(tmp_path, name):
    """--data-dir data (files in data/<name>/) and --data-dir data/<name> both work, as for CIFAR-10."""
    arrays = write_idx_dataset(tmp_path / "files")
    ds = load_dataset(name, "train", tmp_path / "files")
    assert ds.y.tolist() == arrays["train"][1].tolist()
    with pytest.raises(MissingData):               # a folder with neither is still refused
        load_dataset(name, "train", tmp_path / "elsewhere")


def test_idx_header_sizes_must_match_the_data(tmp_path):
    p = tmp_path / "x-idx1-ubyte"
    p.write_bytes(idx_bytes(np.arange(5, dtype=np.uint8)))
    assert read_idx(p).tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("damage, words", [
    (lambda b: b"\x01\x02" + b[2:], "bad magic"),
    (lambda b: b[:6], "truncated IDX header"),
    (lambda b: b[:-10], "truncated or oversized"),
    (lambda b: b + b"\0", "truncated or oversized"),
])
def test_corrupt_idx_names_the_file(tmp_path, damage, words):
    write_idx_dataset(tmp_path / "mnist", gz=False)
    p = tmp_path / "mnist" / "train-images-idx3-ubyte"
    p.write_bytes(damage(p.read_bytes()))
    with pytest.raises(DataError, match=words) as exc:
        load_dataset("mnist", "train", tmp_path)
    assert str(p) in str(exc.value)


def test_truncated_gzip_names_the_file(tmp_path):
    write_idx_dataset(tmp_path / "mnist")
    p = tmp_path / "mnist" / "train-labels-idx1-ubyte.gz"
    p.write_bytes(p.read_bytes()[:-12])
    with pytest.raises(DataError, match="corrupt or truncated gzip") as exc:
        load_dataset("mnist", "train", tmp_path)
    assert str(p) in str(exc.value)


def test_labels_must_match_images_and_classes(tmp_path):
    write_idx_dataset(tmp_path / "mnist", gz=False)
    p = tmp_path / "mnist" / "t10k-labels-idx1-ubyte"
    p.write_bytes(idx_bytes(np.full(9, 3, np.uint8)))
    with pytest.raises(DataError, match="9 labels for 10 images"):
        load_dataset("mnist", "test", tmp_path)
    p.write_bytes(idx_bytes(np.full(10, 10, np.uint8)))
    with pytest.raises(DataError, match=r"labels outside 0\.\.9"):
        load_dataset("mnist", "test", tmp_path)


def test_missing_files_say_where_and_how_to_fetch(tmp_path):
    with pytest.raises(MissingData, match="dbs-mpi data fetch mnist") as exc:
        load_dataset("mnist", "train", tmp_path)
    assert str(tmp_path / "mnist" / "train-images-idx3-ubyte.gz") in str(exc.value)
    with pytest.raises(DataError, match="unknown dataset"):
        load_dataset("cifar100", "train", tmp_path)


# --- CIFAR-10 ----------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["cifar10/cifar-10-batches-py", "cifar-10-batches-py",
                                    "cifar10/cifar-10-batches-bin", "cifar-10-batches-bin"])
def test_cifar10_both_versions_in_both_places(tmp_path, layout):
    arrays = cifar_arrays()
    write_cifar(tmp_path / layout, arrays, binary=layout.endswith("bin"))
    train = load_dataset("cifar10", "train", tmp_path)
    images = np.concatenate([arrays[f"data_batch_{i}"][0] for i in range(1, 6)])
    labels = np.concatenate([arrays[f"data_batch_{i}"][1] for i in range(1, 6)])
    assert train.x.shape == (20, 3, 32, 32) and train.sample_shape == (3, 32, 32)
    torch.testing.assert_close(train.x, expected_x(images, "cifar10"))
    assert train.y.tolist() == labels.tolist()
    test = load_dataset("cifar10", "test", tmp_path)
    assert test.y.tolist() == arrays["test_batch"][1].tolist()


def test_cifar_rows_are_red_then_green_then_blue_planes(tmp_path):
    row = np.zeros(3072, np.uint8)
    row[0], row[1024 + 32 * 5 + 7], row[2048 + 1023] = 255, 255, 255    # R(0,0), G(5,7), B(31,31)
    p = tmp_path / "test_batch.bin"
    p.write_bytes(bytes([4]) + row.tobytes())
    images, labels = read_cifar_binary(p)
    assert labels.tolist() == [4]
    assert np.argwhere(images[0] == 255).tolist() == [[0, 0, 0], [1, 5, 7], [2, 31, 31]]


def test_cifar_pickle_written_by_numpy_2_also_loads(tmp_path):
    images, labels = np.ones((2, 3, 32, 32), np.uint8), [1, 2]
    p = tmp_path / "data_batch_1"
    p.write_bytes(pickle.dumps({b"data": images.reshape(2, -1), b"labels": labels}, protocol=4))
    got, got_labels = read_cifar_pickle(p)
    assert np.array_equal(got, images) and got_labels.tolist() == labels


def test_cifar_pickle_cannot_run_code(tmp_path):
    marker = tmp_path / "was-run"

    class Evil:
        def __reduce__(self):
            return os.mkdir, (str(marker),)

    p = tmp_path / "data_batch_1"
    p.write_bytes(py2_pickle({b"data": Evil(), b"labels": []}))
    with pytest.raises(DataError, match="mkdir") as exc:
        read_cifar_pickle(p)
    assert str(p) in str(exc.value) and not marker.exists()


@pytest.mark.parametrize("content, words", [
    (lambda good: good[: len(good) // 2], "corrupt or truncated CIFAR-10 batch"),
    (lambda good: b"", "corrupt or truncated CIFAR-10 batch"),
    (lambda good: b"\x80\x02garbage" * 10, "corrupt or truncated CIFAR-10 batch"),
    (lambda good: py2_pickle([1, 2, 3]), "not a dict"),
    (lambda good: py2_pickle({b"labels": [1]}), "'data' is not a uint8"),
    (lambda good: py2_pickle({b"data": np.zeros((1, 100), np.uint8), b"labels": [1]}),
     "'data' is not a uint8"),
    (lambda good: py2_pickle({b"data": np.zeros((2, 3072), np.uint8), b"labels": [1]}),
     "1 labels for 2 images"),
    (lambda good: py2_pickle({b"data": np.zeros((1, 3072), np.uint8), b"labels": [b"x"]}),
     "not integers"),
    (lambda good: py2_pickle({b"data": np.zeros((1, 3072), np.uint8), b"labels": [12]}),
     "outside"),
])
def test_corrupt_cifar_pickle_names_the_file(tmp_path, content, words):
    arrays = cifar_arrays()
    folder = tmp_path / "cifar10" / "cifar-10-batches-py"
    write_cifar(folder, arrays)
    p = folder / "data_batch_3"
    p.write_bytes(content(p.read_bytes()))
    with pytest.raises(DataError, match=words) as exc:
        load_dataset("cifar10", "train", tmp_path)
    assert str(p) in str(exc.value)


@pytest.mark.parametrize("content, words", [
    (lambda good: good[:-1], "not a positive multiple of the 3073-byte record"),
    (lambda good: b"", "not a positive multiple"),
    (lambda good: b"\x0a" + good[1:], "outside"),
])
def test_corrupt_cifar_binary_names_the_file(tmp_path, content, words):
    folder = tmp_path / "cifar-10-batches-bin"
    write_cifar(folder, cifar_arrays(), binary=True)
    p = folder / "test_batch.bin"
    p.write_bytes(content(p.read_bytes()))
    with pytest.raises(DataError, match=words) as exc:
        load_dataset("cifar10", "test", tmp_path)
    assert str(p) in str(exc.value)


def test_cifar_missing_batch_or_folder(tmp_path):
    with pytest.raises(MissingData, match="dbs-mpi data fetch cifar10"):
        load_dataset("cifar10", "train", tmp_path)
    folder = tmp_path / "cifar10" / "cifar-10-batches-py"
    write_cifar(folder, cifar_arrays())
    (folder / "data_batch_4").unlink()
    with pytest.raises(MissingData, match="data_batch_4: missing"):
        load_dataset("cifar10", "train", tmp_path)


# --- augmentation -------------------------------------------------------------------------


def reference_augment(x, indices, epoch, seed, padding=4):
    """Per-sample loop: pad, crop at the offsets, flip; the vectorised version must agree."""
    dy, dx, flip = augment_params(indices, epoch, seed, padding)
    out = []
    for i in range(len(x)):
        padded = torch.nn.functional.pad(x[i], (padding,) * 4)
        crop = padded[:, dy[i]:dy[i] + x.shape[2], dx[i]:dx[i] + x.shape[3]]
        out.append(crop.flip(2) if flip[i] else crop)
    return torch.stack(out)


def test_augment_matches_a_per_sample_reference():
    x = torch.randn(64, 3, 32, 32)
    idx = np.arange(1000, 1064)
    out = augment(x, idx, epoch=2, seed=5)
    assert out.shape == x.shape
    assert torch.equal(out, reference_augment(x, idx, 2, 5))


def test_augment_is_a_function_of_seed_epoch_and_index_only():
    n = 500
    data = torch.randn(n, 3, 32, 32)
    idx = np.random.default_rng(0).permutation(n)[:128]
    whole = augment(data[idx], idx, 3, 7)
    assert torch.equal(whole, augment(data[idx], idx, 3, 7))                     # deterministic
    perm = np.random.default_rng(1).permutation(len(idx))                       # other order
    assert torch.equal(augment(data[idx[perm]], idx[perm], 3, 7), whole[perm])
    parts = [augment(data[idx[a:b]], idx[a:b], 3, 7) for a, b in ((0, 1), (1, 50), (50, 128))]
    assert torch.equal(torch.cat(parts), whole)                                 # other batch split
    assert not torch.equal(augment(data[idx], idx, 4, 7), whole)                # new epoch: new crops
    assert not torch.equal(augment(data[idx], idx, 3, 8), whole)                # new seed: new crops


def test_augmented_step_does_not_depend_on_the_batch_vector():
    """Allocation invariance: the union of a step's transformed samples is the same on
    one rank with the global batch as on three ranks with an uneven vector."""
    n, global_batch, epoch, seed = 300, 64, 1, 9
    data = torch.randn(n, 3, 8, 8)
    one = sharding.epoch_shard(n, epoch, seed, global_batch, [global_batch], 0)
    vector = allocation.proportional(global_batch, [1, 0.4, 0.1])
    shards = [sharding.epoch_shard(n, epoch, seed, global_batch, vector, r) for r in range(3)]
    for s in range(len(one)):
        single = augment(data[one[s]], one[s], epoch, seed, padding=2)
        union = torch.cat([augment(data[sh[s]], sh[s], epoch, seed, padding=2) for sh in shards])
        assert torch.equal(single, union)


def test_augment_offsets_and_flips_are_spread_evenly():
    dy, dx, flip = augment_params(np.arange(90_000), epoch=0, seed=0, padding=4)
    for offsets in (dy, dx):
        counts = np.bincount(offsets, minlength=9)
        assert len(counts) == 9 and np.all(np.abs(counts / 10_000 - 1) < 0.05)
    assert abs(flip.mean() - 0.5) < 0.01
    assert abs(np.corrcoef(dy, dx)[0, 1]) < 0.02 and abs(np.corrcoef(dy, flip)[0, 1]) < 0.02


def test_augment_keeps_the_image_and_handles_empty_batches():
    x = torch.arange(2 * 1 * 4 * 4, dtype=torch.float32).view(2, 1, 4, 4) + 1
    assert torch.equal(augment(x, [0, 1], 0, 0, padding=0)[0], reference_augment(x, [0, 1], 0, 0, 0)[0])
    out = augment(x, [0, 1], 0, 0, padding=1)
    assert set(out.unique().tolist()) <= set(x.unique().tolist()) | {0.0}        # pixels or zero padding
    assert augment(torch.empty(0, 3, 32, 32), np.array([], np.int64), 0, 0).shape == (0, 3, 32, 32)


def test_synthetic_data_that_would_not_fit_in_memory_is_refused_in_one_line():
    """A shape or a class count too large for this machine's memory: one line naming the
    size, not torch's allocator error; a small set loads."""
    with pytest.raises(DataError, match=r"^synthetic_samples: 16 samples of shape \(1, 100000, 100000\) .* GiB"):
        load_dataset("synthetic", "train", synthetic_samples=16, synthetic_shape=(1, 100000, 100000))
    with pytest.raises(DataError, match="100000000000 classes"):
        load_dataset("synthetic", "train", synthetic_samples=16, synthetic_classes=10 ** 11)
    assert len(load_dataset("synthetic", "train", synthetic_samples=16)) == 16
