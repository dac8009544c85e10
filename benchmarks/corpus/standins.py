"""Synthetic stand-ins for the data keras-io's examples download: the same shapes and dtypes, far fewer samples, made
with NumPy from a fixed seed (nothing downloads; both runs of an example see the same bytes).

Labels are made learnable (a class's images are brighter in a class-specific region), so a fit's loss moves.
"""

from __future__ import annotations

import csv
import io
import os
import zipfile
from pathlib import Path

import numpy as np


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def images(n: int, shape: tuple[int, ...], classes: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """uint8 images whose class shows as a brighter horizontal band, and their int labels."""
    rng = _rng(seed)
    y = rng.integers(0, classes, size=n).astype("uint8")
    x = rng.integers(0, 90, size=(n, *shape)).astype("uint8")
    h = shape[0]
    band = max(1, h // classes)
    for i, c in enumerate(y):
        lo = (int(c) * band) % max(1, h - band + 1)
        x[i, lo : lo + band] = np.clip(x[i, lo : lo + band].astype(int) + 150, 0, 255).astype("uint8")
    return x, y


def mnist(n_train: int = 512, n_test: int = 128) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """keras.datasets.mnist.load_data(): uint8 (n, 28, 28), uint8 labels 0-9."""
    x, y = images(n_train + n_test, (28, 28), 10, seed=1)
    return (x[:n_train], y[:n_train]), (x[n_train:], y[n_train:])


def fashion_mnist(n_train: int = 512, n_test: int = 128):  # noqa: ANN201 - the same tuple shape as mnist()
    """keras.datasets.fashion_mnist.load_data()."""
    x, y = images(n_train + n_test, (28, 28), 10, seed=2)
    return (x[:n_train], y[:n_train]), (x[n_train:], y[n_train:])


def cifar10(n_train: int = 256, n_test: int = 64, classes: int = 10):  # noqa: ANN201
    """keras.datasets.cifar10.load_data(): uint8 (n, 32, 32, 3), uint8 labels of shape (n, 1)."""
    x, y = images(n_train + n_test, (32, 32, 3), classes, seed=3)
    y = y.reshape(-1, 1)
    return (x[:n_train], y[:n_train]), (x[n_train:], y[n_train:])


def cifar100(n_train: int = 256, n_test: int = 64):  # noqa: ANN201
    """keras.datasets.cifar100.load_data()."""
    return cifar10(n_train, n_test, classes=100)


def imdb(num_words: int = 20000, n_train: int = 256, n_test: int = 64, maxlen: int = 120):  # noqa: ANN201
    """keras.datasets.imdb.load_data(num_words=...): object arrays of int lists (as Keras gives them), labels 0/1."""
    rng = _rng(4)
    out = []
    for n in (n_train, n_test):
        y = rng.integers(0, 2, size=n).astype("int64")
        seqs = np.empty(n, dtype=object)
        for i in range(n):
            length = int(rng.integers(20, maxlen))
            base = rng.integers(2, num_words, size=length)
            if y[i]:
                base[: length // 3] = rng.integers(2, 50, size=length // 3)  # "positive" words are frequent ones
            seqs[i] = [1, *base.tolist()]
        out.append((seqs, y))
    return tuple(out)


WORDS_POS = "great wonderful superb moving brilliant fun loved excellent".split()
WORDS_NEG = "awful boring terrible dull waste bad hated worst".split()
WORDS = "the a film movie story actor plot scene was is and but it this of to".split()


def sentence(rng: np.random.Generator, label: int, length: int = 30) -> str:
    words = list(rng.choice(WORDS, size=length))
    pool = WORDS_POS if label else WORDS_NEG
    for k in rng.integers(0, length, size=4):
        words[int(k)] = str(rng.choice(pool))
    return " ".join(words)


def text_folders(
    root: str, splits: tuple[str, ...] = ("train", "test"), per_class: int = 64, vocabulary: int = 0
) -> str:
    """The aclImdb layout: ROOT/{train,test}/{neg,pos}/N.txt with short reviews; with `vocabulary`, one more review
    holding that many distinct words, so a vocabulary sized for IMDB fills up as it does on the real data."""
    rng = _rng(5)
    for split in splits:
        for label, name in ((0, "neg"), (1, "pos")):
            d = Path(root) / split / name
            d.mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                (d / f"{i}_{label}.txt").write_text(sentence(rng, label) + "<br />")
    if vocabulary:
        words = " ".join(f"w{i}" for i in range(vocabulary))
        (Path(root) / splits[0] / "pos" / "vocabulary_1.txt").write_text(words)
    return root


def image_folders(root: str, classes: tuple[str, ...], per_class: int = 24, size: int = 64) -> str:
    """ROOT/CLASS/N.jpg, real JPEG files (PIL) whose class shows as a band, for image_dataset_from_directory."""
    from PIL import Image

    rng = _rng(6)
    for c, name in enumerate(classes):
        d = Path(root) / name
        d.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            img = rng.integers(0, 90, size=(size, size, 3)).astype("uint8")
            lo = (c * size // len(classes)) % size
            img[lo : lo + size // len(classes)] += 150
            Image.fromarray(img).save(d / f"{i}.jpg", quality=90)
    return root


def timeseries_table(n: int = 64, length: int = 500, seed: int = 7) -> np.ndarray:
    """FordA's .tsv rows: a label (-1 or 1) then `length` float readings; class 1 is a faster sine."""
    rng = _rng(seed)
    y = rng.choice([-1, 1], size=n)
    t = np.linspace(0, 8 * np.pi, length)
    x = np.stack([np.sin(t * (2 if c > 0 else 1) + rng.uniform(0, 6)) for c in y]) + rng.normal(0, 0.3, (n, length))
    return np.column_stack([y, x])


def forda(root: str, n_train: int = 64, n_test: int = 32) -> str:
    """FordA_TRAIN.tsv / FordA_TEST.tsv in ROOT (the URLs the example reads become these paths)."""
    Path(root).mkdir(parents=True, exist_ok=True)
    np.savetxt(os.path.join(root, "FordA_TRAIN.tsv"), timeseries_table(n_train, seed=7), delimiter="\t")
    np.savetxt(os.path.join(root, "FordA_TEST.tsv"), timeseries_table(n_test, seed=8), delimiter="\t")
    return root


def write_csv(path: str, header: list[str], rows: list[list[object]]) -> str:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


def heart_csv(path: str, n: int = 240) -> str:
    """The Cleveland heart-disease CSV of the structured-data examples: the same 14 columns and value kinds."""
    rng = _rng(9)
    rows = []
    for _ in range(n):
        target = int(rng.integers(0, 2))
        rows.append(
            [
                int(rng.integers(29, 77)),  # age
                int(rng.integers(0, 2)),  # sex
                int(rng.integers(0, 5)),  # cp
                int(rng.integers(94, 200)),  # trestbps
                int(rng.integers(126, 564)),  # chol
                int(rng.integers(0, 2)),  # fbs
                int(rng.integers(0, 3)),  # restecg
                int(rng.integers(71, 202)) + 20 * target,  # thalach
                int(rng.integers(0, 2)),  # exang
                round(float(rng.uniform(0, 6.2)), 1),  # oldpeak
                int(rng.integers(0, 4)),  # slope
                int(rng.integers(0, 4)),  # ca
                str(rng.choice(["fixed", "normal", "reversible"])),  # thal
                target,
            ]
        )
    header = "age,sex,cp,trestbps,chol,fbs,restecg,thalach,exang,oldpeak,slope,ca,thal,target".split(",")
    return write_csv(path, header, rows)


def creditcard_csv(path: str, n: int = 600) -> str:
    """creditcard.csv (imbalanced classification): Time, V1..V28, Amount, Class with about 2 % frauds."""
    rng = _rng(10)
    header = ["Time", *[f"V{i}" for i in range(1, 29)], "Amount", "Class"]
    rows = []
    for i in range(n):
        fraud = int(rng.random() < 0.05)
        v = rng.normal(0, 1, 28) + (2.0 if fraud else 0.0)
        rows.append([float(i), *[round(float(a), 5) for a in v], round(float(rng.uniform(0, 300)), 2), f'"{fraud}"'])
    with open(path, "w") as f:
        f.write(",".join(f'"{h}"' for h in header) + "\n")
        for r in rows:
            f.write(",".join(str(c) for c in r) + "\n")
    return path


def movielens_csv(path: str, n: int = 2000, users: int = 60, movies: int = 80) -> str:
    """ratings.csv of MovieLens small: userId, movieId, rating, timestamp."""
    rng = _rng(11)
    u = rng.integers(1, users + 1, n)
    m = rng.integers(1, movies + 1, n)
    r = np.clip(np.round(((u % 5) + (m % 5)) / 2 + rng.normal(0, 0.5, n)) / 1.0 + 0.5, 0.5, 5.0)
    rows = [[int(a), int(b), float(c), 964982703 + i] for i, (a, b, c) in enumerate(zip(u, m, r))]
    return write_csv(path, ["userId", "movieId", "rating", "timestamp"], rows)


def nab_csv(path: str, n: int = 4032, anomaly: bool = False) -> str:
    """NAB's art_daily_*.csv: timestamp, value every 5 minutes (a daily cycle), with a jump when `anomaly`."""
    rng = _rng(12 + int(anomaly))
    t0 = np.datetime64("2014-04-01T00:00:00")
    ts = [str(t0 + np.timedelta64(5 * i, "m")).replace("T", " ") for i in range(n)]
    v = 20 + 10 * (np.sin(np.arange(n) * 2 * np.pi / 288) > 0) + rng.normal(0, 1, n)
    if anomaly:
        v[3000:3020] += 60
    return write_csv(path, ["timestamp", "value"], [[a, round(float(b), 4)] for a, b in zip(ts, v)])


def jena_csv(path: str, n: int = 6000) -> str:
    """jena_climate_2009_2016.csv: 'Date Time' and 14 weather columns every 10 minutes."""
    rng = _rng(14)
    cols = [
        "p (mbar)",
        "T (degC)",
        "Tpot (K)",
        "Tdew (degC)",
        "rh (%)",
        "VPmax (mbar)",
        "VPact (mbar)",
        "VPdef (mbar)",
        "sh (g/kg)",
        "H2OC (mmol/mol)",
        "rho (g/m**3)",
        "wv (m/s)",
        "max. wv (m/s)",
        "wd (deg)",
    ]
    t = np.arange(n)
    day = np.sin(t * 2 * np.pi / 144)
    rows = []
    for i in range(n):
        base = [990 + day[i] * 5, 10 + day[i] * 8, 283 + day[i] * 8, 5 + day[i] * 3, 70 - day[i] * 10]
        rest = list(rng.normal(5, 1, 9))
        vals = [round(float(v + rng.normal(0, 0.2)), 2) for v in base + rest]
        stamp = f"{1 + (i // 144) % 28:02d}.01.2009 {(i % 144) // 6:02d}:{(i % 6) * 10:02d}:00"
        rows.append([stamp, *vals])
    return write_csv(path, ["Date Time", *cols], rows)


def celeba_zip(path: str, n: int = 64, size: int = 64) -> str:
    """The CelebA zip the DCGAN example downloads: img_align_celeba/NNNNNN.jpg faces (here: noise with a band)."""
    from PIL import Image

    rng = _rng(15)
    with zipfile.ZipFile(path, "w") as z:
        for i in range(n):
            img = rng.integers(0, 255, size=(size, size, 3)).astype("uint8")
            buf = io.BytesIO()
            Image.fromarray(img).save(buf, format="JPEG", quality=90)
            z.writestr(f"img_align_celeba/{i + 1:06d}.jpg", buf.getvalue())
    return path


class FakeTfds:
    """What the examples use of tensorflow_datasets (not installed here): `load(name, split=[...],
    as_supervised=True)` gives one tf.data.Dataset per split of (uint8 image of its own size, int64 label), like
    cats_vs_dogs; `disable_progress_bar()` does nothing."""

    def __init__(self, per_split: int = 32, classes: int = 2) -> None:
        self.per_split = per_split
        self.classes = classes

    def disable_progress_bar(self) -> None:
        return None

    def load(self, name: str, split: object = "train", as_supervised: bool = False, **kwargs: object):  # noqa: ANN201
        import tensorflow as tf

        splits = split if isinstance(split, (list, tuple)) else [split]
        out = []
        for k, _ in enumerate(splits):
            rng = _rng(100 + k)
            items = []
            for _ in range(self.per_split if k == 0 else self.per_split // 2):
                h, w = int(rng.integers(120, 200)), int(rng.integers(120, 200))
                label = int(rng.integers(0, self.classes))
                img = rng.integers(0, 90, size=(h, w, 3)).astype("uint8")
                img[: h // 2 if label else h] += 100
                items.append((img, label))

            def gen(items=items):  # noqa: ANN202
                for img, label in items:
                    yield img, np.int64(label)

            ds = tf.data.Dataset.from_generator(
                gen,
                output_signature=(
                    tf.TensorSpec((None, None, 3), tf.uint8),
                    tf.TensorSpec((), tf.int64),
                ),
            )
            ds = ds.apply(tf.data.experimental.assert_cardinality(len(items)))
            out.append(ds if as_supervised else ds.map(lambda x, y: {"image": x, "label": y}))
        return out if isinstance(split, (list, tuple)) else out[0]


def movielens_zip(name: str) -> str:
    """keras.utils.get_file("ml-latest-small.zip", ...): the zip, written in the current folder, holding
    ml-latest-small/ratings.csv and movies.csv; its absolute path, as get_file returns."""
    folder = Path("ml-latest-small-src")
    movielens_csv(str(folder / "ratings.csv"))
    write_csv(
        str(folder / "movies.csv"),
        ["movieId", "title", "genres"],
        [[i, f"Movie {i} (2000)", "Drama|Comedy"] for i in range(1, 81)],
    )
    with zipfile.ZipFile(name, "w") as z:
        for f in ("ratings.csv", "movies.csv"):
            z.write(folder / f, f"ml-latest-small/{f}")
    return os.path.abspath(name)


def jena_zip(name: str) -> str:
    """keras.utils.get_file(origin=..., fname="jena_climate_2009_2016.csv.zip"): the zip, with the CSV inside."""
    jena_csv("jena_climate_2009_2016.csv.src")
    with zipfile.ZipFile(name, "w") as z:
        z.write("jena_climate_2009_2016.csv.src", "jena_climate_2009_2016.csv")
    return os.path.abspath(name)


def text_file(name: str, chars: int = 6000) -> str:
    """A plain-text corpus (nietzsche.txt and the like): sentences of common words, lower and upper case."""
    rng = _rng(16)
    words = [*WORDS, *WORDS_POS, *WORDS_NEG, "Truth", "The", "philosopher", "will", "power"]
    out: list[str] = []
    while sum(len(w) + 1 for w in out) < chars:
        out.append(str(rng.choice(words)) + ("." if rng.random() < 0.1 else ""))
    Path(name).write_text(" ".join(out) + "\n")
    return os.path.abspath(name)


def fra_txt(path: str, n: int = 300) -> str:
    """fra.txt of the Anki English-French pairs: 'english<TAB>french<TAB>attribution' per line."""
    rng = _rng(17)
    en = "go run stop wait help come see hello thanks sorry".split()
    fr = "va cours arrete attends aide viens regarde bonjour merci pardon".split()
    lines = []
    for _ in range(n):
        k = rng.integers(1, 4)
        idx = rng.integers(0, len(en), size=k)
        lines.append(
            " ".join(en[i] for i in idx).capitalize() + ".\t" + " ".join(fr[i] for i in idx).capitalize() + " !\tCC-BY"
        )
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def speech_folders(root: str, speakers: int = 5, per_speaker: int = 16, rate: int = 16000) -> str:
    """The Kaggle speaker-recognition layout: ROOT/<speaker>/N.wav (1 s, 16 kHz, int16; each speaker a tone of its
    own pitch) and ROOT/_background_noise_/N.wav (3 s of noise)."""
    from scipy.io import wavfile

    rng = _rng(18)
    t = np.arange(rate) / rate
    for s in range(speakers):
        d = Path(root) / f"Speaker_{s:04d}"
        d.mkdir(parents=True, exist_ok=True)
        for i in range(per_speaker):
            wave = 0.5 * np.sin(2 * np.pi * (200 + 120 * s) * t) + rng.normal(0, 0.05, rate)
            wavfile.write(d / f"{i}.wav", rate, (wave * 20000).astype("int16"))
    noise = Path(root) / "_background_noise_"
    noise.mkdir(parents=True, exist_ok=True)
    for i in range(2):
        wavfile.write(noise / f"noise_{i}.wav", rate, (rng.normal(0, 0.3, 3 * rate) * 20000).astype("int16"))
    return root


TOPICS = {
    "alt.atheism": "god belief religion argument faith".split(),
    "comp.graphics": "graphics image render polygon pixel".split(),
    "rec.autos": "car engine wheel drive road".split(),
    "sci.space": "orbit rocket nasa launch moon".split(),
}


def news20(path: str, *get_file_args: object, per_class: int = 20, **get_file_kwargs: object) -> str:
    """keras.utils.get_file("news20.tar.gz", ..., untar=True): DIR/20_newsgroup/<group>/<id> posts with ten header
    lines (comp.graphics holds the 38987 the example prints); the path get_file gives, whose parent holds them.
    get_file's own arguments are taken and ignored, so the call stays as printed."""
    rng = _rng(19)
    root = Path(path).parent / "20_newsgroup"
    for group, words in TOPICS.items():
        d = root / group
        d.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            header = [f"Newsgroup: {group}", f"Document_id: {38987 + i}", "From: someone", "Subject: a post"]
            header += ["Organization: none"] * 6
            body = " ".join(rng.choice([*words, "the", "cat", "sat", "on", "mat", "and"], size=60))
            (d / str(38987 + i)).write_text("\n".join(header) + "\n" + body + "\n", encoding="latin-1")
    return path


def glove(path: str, dim: int = 100) -> str:
    """glove.6B.100d.txt: 'word v1 ... v100' lines for the stand-in posts' words."""
    rng = _rng(20)
    words = {w for ws in TOPICS.values() for w in ws} | {"the", "cat", "sat", "on", "mat", "and"}
    with open(path, "w") as f:
        for w in sorted(words):
            f.write(w + " " + " ".join(f"{v:.5f}" for v in rng.normal(0, 0.5, dim)) + "\n")
    return path


def arxiv_csv(path: str, n: int = 400) -> str:
    """arxiv_data.csv: titles, summaries, terms (a Python list literal of arXiv categories)."""
    rng = _rng(21)
    combos = [["cs.LG"], ["cs.CV", "cs.LG"], ["stat.ML", "cs.LG"], ["cs.CL"]]
    words = {
        "cs.LG": "learning gradient model training loss".split(),
        "cs.CV": "image vision pixel convolution segmentation".split(),
        "stat.ML": "bayesian posterior inference statistical prior".split(),
        "cs.CL": "language text token translation parsing".split(),
    }
    rows = []
    for i in range(n):
        terms = combos[i % len(combos)]
        pool = [w for t in terms for w in words[t]] + "we propose a new method for the".split()
        rows.append([f"Paper number {i}", " ".join(rng.choice(pool, size=40)), str(terms)])
    return write_csv(path, ["titles", "summaries", "terms"], rows)


def plot_model(*args: object, **kwargs: object) -> None:
    """keras.utils.plot_model needs pydot and graphviz, which are not installed: draw nothing."""
    return None
