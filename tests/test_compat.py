"""One test per third-party internal that aibro_core/compat relies on, named after it, run against the installed
library: a release that drops or changes one fails the test that names it (tests/try_newest.py runs these against
the newest releases)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
import tornado.httpserver
import tornado.iostream
import tornado.netutil
import tornado.web
from tornado.ioloop import IOLoop

from aibro_core.compat import keras as keras_compat
from aibro_core.compat import keras_tuner as kt_compat
from aibro_core.compat import tensorflow as tf_compat
from aibro_core.compat import tornado as tornado_compat

fast = pytest.mark.fast


# -- tornado ---------------------------------------------------------------------------------------------------------
class Reason(tornado.web.RequestHandler):
    def get(self) -> None:
        self.set_status(418, "Short And Stout")
        self.finish(tornado_compat.status_reason(self))


class Servers:
    """An HTTPServer on a thread of its own whose connections reach it through `connection_handler` alone."""

    def __init__(self) -> None:
        self.http: tornado.httpserver.HTTPServer | None = None
        self.loop: IOLoop | None = None
        self.port = 0

    def call(self, fn: Any) -> Any:
        """`fn()` on the server's loop; its result."""
        done, out = threading.Event(), {}

        def run() -> None:
            out["value"] = fn()
            done.set()

        assert self.loop is not None
        self.loop.add_callback(run)
        assert done.wait(10)
        return out["value"]


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    s, ready = Servers(), threading.Event()

    def run() -> None:
        asyncio.set_event_loop(asyncio.new_event_loop())
        s.http = tornado.httpserver.HTTPServer(tornado.web.Application([(r"/reason", Reason)]))
        [sock] = tornado.netutil.bind_sockets(0, "127.0.0.1", family=socket.AF_INET)
        s.port = sock.getsockname()[1]
        handle = tornado_compat.connection_handler(s.http)
        tornado.netutil.add_accept_handler(sock, handle)  # instead of add_sockets: ours, as server/listener.py
        s.loop = IOLoop.current()
        ready.set()
        s.loop.start()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(10)
    yield s
    assert s.loop is not None
    s.loop.add_callback(s.loop.stop)
    thread.join(timeout=10)


@fast
def test_tcpserver_handle_connection_serves_a_connection_accepted_elsewhere(servers: Servers) -> None:
    assert requests.get(f"http://127.0.0.1:{servers.port}/reason", timeout=10).status_code == 418


@fast
def test_requesthandler_reason_is_the_status_reason(servers: Servers) -> None:
    answer = requests.get(f"http://127.0.0.1:{servers.port}/reason", timeout=10)
    assert answer.reason == "Short And Stout" and answer.text == "Short And Stout"


@fast
def test_httpserver_connections_holds_each_open_connection(servers: Servers) -> None:
    with requests.Session() as session:  # keep-alive: the connection stays open after the answer
        session.get(f"http://127.0.0.1:{servers.port}/reason", timeout=10)
        conns = servers.call(lambda: tornado_compat.open_connections(servers.http))
        assert len(conns) == 1 and isinstance(conns[0].stream, tornado.iostream.IOStream)


@fast
def test_iostream_total_write_done_index_counts_bytes_written() -> None:
    async def main() -> tuple[int | None, int | None]:
        a, b = socket.socketpair()
        stream = tornado.iostream.IOStream(a)
        before = tornado_compat.bytes_written(stream)
        await stream.write(b"x" * 1000)
        after = tornado_compat.bytes_written(stream)
        stream.close()
        b.close()
        return before, after

    assert asyncio.run(main()) == (0, 1000)


@fast
def test_requesthandler_stream_request_body_marks_a_streaming_handler() -> None:
    @tornado.web.stream_request_body
    class Streaming(tornado.web.RequestHandler):
        pass

    assert tornado_compat.streams_request_body(Streaming) is True
    assert tornado_compat.streams_request_body(Reason) is False


@tornado.web.stream_request_body
class Sink(tornado.web.RequestHandler):
    def prepare(self) -> None:
        self.digest = hashlib.sha256()

    def data_received(self, chunk: bytes) -> None:
        self.digest.update(chunk)

    def put(self) -> None:
        self.finish(self.digest.hexdigest())


class Replaced(tornado.httpserver.HTTPServer):
    """Each connection's fixed-length bodies read by `read` below: in pieces it delivers itself, or tornado's way."""

    reads: list[int] = []
    tornado_way = False

    def start_request(self, server_conn: object, request_conn: Any) -> Any:
        async def read(content_length: int, delegate: Any) -> None:
            Replaced.reads.append(content_length)
            if Replaced.tornado_way:
                return await tornado_compat.read_fixed_body_as_tornado(request_conn, content_length, delegate)
            while content_length > 0:
                piece = await request_conn.stream.read_bytes(min(65536, content_length), partial=True)
                content_length -= len(piece)
                await tornado_compat.deliver_body(request_conn, delegate, piece)

        assert tornado_compat.replace_fixed_body_reader(request_conn, read)
        return super().start_request(server_conn, request_conn)


@pytest.fixture(scope="module")
def replaced() -> Iterator[str]:
    ready, where = threading.Event(), {}

    def run() -> None:
        asyncio.set_event_loop(asyncio.new_event_loop())
        http = Replaced(tornado.web.Application([(r"/sink", Sink)]))
        sockets = tornado.netutil.bind_sockets(0, "127.0.0.1", family=socket.AF_INET)
        http.add_sockets(sockets)
        where["url"], where["loop"] = f"http://127.0.0.1:{sockets[0].getsockname()[1]}/sink", IOLoop.current()
        ready.set()
        IOLoop.current().start()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(10)
    yield where["url"]
    where["loop"].add_callback(where["loop"].stop)
    thread.join(timeout=10)


@fast
@pytest.mark.parametrize("tornado_way", [False, True], ids=["pieces_through_deliver_body", "read_as_tornado"])
def test_http1connection_read_fixed_body_is_replaced(replaced: str, tornado_way: bool) -> None:
    """The replacement reads each fixed-length body: in pieces handed on by `_deliver_body`, or by tornado's own
    `_read_fixed_body` called from it."""
    body = os.urandom(300_000)
    Replaced.reads.clear()
    Replaced.tornado_way = tornado_way
    assert requests.put(replaced, data=body, timeout=10).text == hashlib.sha256(body).hexdigest()
    assert Replaced.reads == [len(body)]


@fast
def test_replace_fixed_body_reader_leaves_other_connections() -> None:
    assert tornado_compat.replace_fixed_body_reader(object(), lambda n, d: None) is False  # type: ignore[arg-type,return-value]


# -- Keras -----------------------------------------------------------------------------------------------------------
def small_model() -> Any:
    import keras

    inner = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, name="inner_dense")], name="inner")
    inputs = {"a": keras.Input((3,), name="a")}
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(inner(inputs["a"])))
    return model


@fast
def test_trainer_compile_config_holds_the_live_compile_arguments() -> None:
    import keras

    model = small_model()
    loss = keras.losses.MeanSquaredError()
    model.compile(optimizer="sgd", loss=loss, metrics=["mae"])
    config = keras_compat.compile_config(model)
    assert config["loss"] is loss and config["metrics"] == ["mae"]
    assert keras_compat.compile_config(model) is config  # Keras' own dict, not a copy
    assert keras_compat.compile_config(small_model()) == {}


@fast
def test_layer_flatten_layers_walks_nested_models() -> None:
    names = [layer.name for layer in keras_compat.nested_layers(small_model())]
    assert "inner" in names and "inner_dense" in names and "head" in names


@fast
def test_optimizer_trainable_variables_are_what_build_was_given() -> None:
    import keras

    model = small_model()
    optimizer = keras.optimizers.Adam()
    assert keras_compat.optimizer_variables(optimizer) == []
    optimizer.build(model.trainable_variables)
    assert [id(v) for v in keras_compat.optimizer_variables(optimizer)] == [id(v) for v in model.trainable_variables]


@fast
def test_functional_inputs_struct_keeps_the_inputs_structure() -> None:
    struct = keras_compat.inputs_struct(small_model())
    assert isinstance(struct, dict) and list(struct) == ["a"]


@fast
def test_loss_function_wrapper_fn_kwargs_holds_the_function_arguments() -> None:
    import keras

    loss = keras.losses.SparseCategoricalCrossentropy(ignore_class=0)
    assert (keras_compat.loss_function_kwargs(loss) or {}).get("ignore_class") == 0
    assert keras_compat.loss_function_kwargs(object()) is None


@fast
def test_rng_utils_get_random_seed_reads_set_random_seed() -> None:
    import keras

    keras.utils.set_random_seed(1234)
    assert keras_compat.random_seed() == 1234


@fast
def test_global_state_seed_generator_reads_and_restores_the_global_generator() -> None:
    import keras

    keras.random.uniform((1,))  # an unseeded draw makes the global generator
    key, generator = keras_compat.global_seed_generator()
    assert isinstance(generator, keras.random.SeedGenerator)
    keras_compat.set_global_seed_generator(key, None)
    assert keras_compat.global_seed_generator()[1] is None
    keras_compat.set_global_seed_generator(key, generator)
    assert keras_compat.global_seed_generator()[1] is generator


@fast
def test_saving_lib_get_attr_skipset_reads_the_precomputed_key() -> None:
    from keras.src.saving import saving_lib

    keras_compat.precompute_save_skipsets(("Layer",))
    first = saving_lib.get_attr_skipset("Layer")
    assert isinstance(first, set) and first
    assert saving_lib.get_attr_skipset("Layer") is first  # the save walk finds it stored: no objects built again


class TensorBoardSeen:
    """What the TensorBoard internals gave at the end of one epoch of a real fit."""

    def __init__(self) -> None:
        self.logs: dict[str, Any] = {}
        self.steps_per_second: float | None = None
        self.writers: dict[bool, Any] = {}
        self.eval_iterator: Any = None
        self.log_dir = Path()


@pytest.fixture(scope="module")
def tensorboard(tmp_path_factory: pytest.TempPathFactory) -> TensorBoardSeen:
    import keras

    seen = TensorBoardSeen()
    seen.log_dir = tmp_path_factory.mktemp("tb")

    class Probe(keras.callbacks.TensorBoard):
        def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
            seen.logs = keras_compat.tensorboard_with_learning_rate(self, dict(logs or {}))
            seen.steps_per_second = keras_compat.tensorboard_steps_per_second(self)
            seen.writers = {v: keras_compat.tensorboard_writer(self, v) for v in (False, True)}
            keras_compat.tensorboard_log_weights(self, epoch)
            keras_compat.tensorboard_log_embeddings(self, epoch)
            seen.eval_iterator = keras_compat.eval_epoch_iterator(self.model)

    model = keras.Sequential([keras.Input((4,)), keras.layers.Embedding(10, 2), keras.layers.Flatten()])
    model.add(keras.layers.Dense(1))
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.random.default_rng(0).integers(0, 10, (16, 4)), np.zeros((16, 1))
    probe = Probe(log_dir=str(seen.log_dir), histogram_freq=1, embeddings_freq=1, write_steps_per_second=True)
    model.fit(x, y, validation_data=(x, y), epochs=1, batch_size=8, verbose=0, callbacks=[probe])
    return seen


@fast
def test_tensorboard_collect_learning_rate_adds_it(tensorboard: TensorBoardSeen) -> None:
    assert "learning_rate" in tensorboard.logs and "loss" in tensorboard.logs


@fast
def test_tensorboard_compute_steps_per_second(tensorboard: TensorBoardSeen) -> None:
    assert isinstance(tensorboard.steps_per_second, float) and tensorboard.steps_per_second > 0


@fast
def test_tensorboard_train_writer_and_val_writer(tensorboard: TensorBoardSeen) -> None:
    assert all(hasattr(w, "as_default") for w in tensorboard.writers.values())
    assert {"train", "validation"} <= {p.name for p in tensorboard.log_dir.iterdir()}


@fast
def test_tensorboard_log_weights_writes_histograms(tensorboard: TensorBoardSeen) -> None:
    assert any((tensorboard.log_dir / "train").iterdir())


@fast
def test_tensorboard_log_embeddings_writes_a_checkpoint(tensorboard: TensorBoardSeen) -> None:
    assert any(p.name.startswith("keras_embedding") for p in (tensorboard.log_dir / "train").iterdir())


@fast
def test_trainer_eval_epoch_iterator_is_kept_between_epochs(tensorboard: TensorBoardSeen) -> None:
    assert tensorboard.eval_iterator is not None


# -- TensorFlow ------------------------------------------------------------------------------------------------------
@fast
def test_eager_context_rng_draws_op_seeds() -> None:
    rng = tf_compat.eager_op_seeds()
    assert rng is not None
    state = rng.getstate()
    rng.setstate(state)


@fast
def test_dataset_input_dataset_and_repeat_count() -> None:
    import tensorflow as tf

    base = tf.data.Dataset.range(4)
    repeated = base.repeat()
    prefetched = repeated.prefetch(1)
    assert type(tf_compat.dataset_input(prefetched)).__name__.lstrip("_") == "RepeatDataset"
    assert tf_compat.repeat_count(repeated) == -1 and tf_compat.repeat_count(base.repeat(3)) == 3
    assert int(tf_compat.dataset_input(repeated).cardinality()) == 4


@fast
def test_the_stage_kinds_travelling_pass_looks_for() -> None:
    import tensorflow as tf

    repeated = tf.data.Dataset.range(4).repeat()
    options = tf.data.Options()
    options.deterministic = True
    assert tf_compat.stage_kind(repeated) == "RepeatDataset"
    assert tf_compat.stage_kind(repeated.prefetch(1)) == "PrefetchDataset"
    assert tf_compat.stage_kind(repeated.with_options(options)) == "OptionsDataset"


@fast
def test_an_endless_repeat_of_a_finite_dataset_travels_once_and_repeats_on_the_worker() -> None:
    """`.repeat().prefetch()` of 4 elements travels as those 4, repeated there; an endless pipeline that is not a
    repeat of a finite one travels as the batches fit draws (steps x epochs)."""
    import tensorflow as tf

    from aibro_jupyter.dataset_blob import travelling_pass

    base = tf.data.Dataset.range(4)
    sent, repeat = travelling_pass(base.repeat().prefetch(tf.data.AUTOTUNE), steps=3, epochs=2)
    assert repeat and int(sent.cardinality()) == 4 and [int(v) for v in sent] == [0, 1, 2, 3]
    endless = base.repeat().map(lambda v: v + 1)
    sent, repeat = travelling_pass(endless, steps=3, epochs=2)
    assert not repeat and [int(v) for v in sent] == [1, 2, 3, 4, 1, 2]


@fast
def test_dataset_inputs_walks_a_pipeline() -> None:
    import tensorflow as tf

    shuffled = tf.data.Dataset.range(4).shuffle(4)
    mapped = shuffled.map(lambda v: v + 1)
    assert [type(d).__name__ for d in tf_compat.dataset_inputs(mapped)] == [type(shuffled).__name__]


# -- KerasTuner ------------------------------------------------------------------------------------------------------
def build(hp: Any) -> Any:
    import keras

    model = keras.Sequential([keras.layers.Dense(hp.Int("units", 1, 4))])
    model.compile(optimizer="adam", loss="mse")
    return model


@fast
def test_oracle_maybe_infer_direction_from_objective() -> None:
    import keras_tuner as kt

    assert kt_compat.infer_direction(kt.Objective("val_score", "max"), "val_score") == "max"
    objectives = [kt.Objective("val_loss", "min"), kt.Objective("val_acc", "max")]
    assert kt_compat.infer_direction(objectives, "val_loss") == "min"
    assert kt_compat.infer_direction(objectives, "loss") is None


@fast
def test_oracle_set_project_dir_and_save_trial(tmp_path: Path) -> None:
    import keras_tuner as kt

    oracle = kt.oracles.RandomSearchOracle(objective="loss", max_trials=2, seed=1)
    oracle.hyperparameters.Int("units", 1, 4)
    kt_compat.set_project_dir(oracle, str(tmp_path), "oracle")
    trial = oracle.create_trial("slot-0")
    kt_compat.save_trial(oracle, trial)
    saved = json.loads((tmp_path / "oracle" / f"trial_{trial.trial_id}" / "trial.json").read_text())
    assert saved["trial_id"] == trial.trial_id


@fast
def test_oracle_retry_queue_holds_reloaded_running_trials(tmp_path: Path) -> None:
    import keras_tuner as kt

    def oracle() -> Any:
        made = kt.oracles.RandomSearchOracle(objective="loss", max_trials=5, seed=1)
        made.hyperparameters.Int("units", 1, 4)
        kt_compat.set_project_dir(made, str(tmp_path), "oracle")
        return made

    first = oracle()
    running = first.create_trial("slot-0").trial_id
    first.save()
    again = oracle()
    again.reload()  # puts the running trial back in the retry queue: create_trial would hand it out again
    kt_compat.forget_pending_retry(again, running)
    assert again.create_trial("slot-0").trial_id != running


@fast
def test_utils_save_json(tmp_path: Path) -> None:
    """The oracle host's saves go through KerasTuner's utils.save_json (from Stateful.save): replaced, a save is a
    rename of a whole file, and a save cut short leaves the last whole one, which reload() reads."""
    import keras_tuner as kt
    from keras_tuner.src import utils

    original = utils.save_json
    kt_compat.atomic_json_saves()
    try:
        oracle = kt.oracles.RandomSearchOracle(objective="loss", max_trials=3, seed=1)
        oracle.hyperparameters.Int("units", 1, 4)
        kt_compat.set_project_dir(oracle, str(tmp_path), "oracle")
        trial = oracle.create_trial("slot-0")
        oracle.save()
        saved = tmp_path / "oracle" / "oracle.json"
        before = saved.read_text()
        assert json.loads(before) and not list(saved.parent.glob("*.part-*"))

        def killed(part: str, path: str) -> None:
            raise KeyboardInterrupt  # the process goes away between writing the new file and renaming it

        real_replace, os.replace = os.replace, killed
        try:
            with pytest.raises(KeyboardInterrupt):
                oracle.create_trial("slot-1")  # saves the oracle and the new trial
        finally:
            os.replace = real_replace
        assert saved.read_text() == before, "the last whole state stays"
        again = kt.oracles.RandomSearchOracle(objective="loss", max_trials=3, seed=1)
        again.hyperparameters.Int("units", 1, 4)
        kt_compat.set_project_dir(again, str(tmp_path), "oracle")
        again.reload()
        assert trial.trial_id in again.trials
    finally:
        utils.save_json = original


@fast
def test_tuner_try_build_and_checkpoint_and_build_config_fnames(tmp_path: Path) -> None:
    import keras_tuner as kt

    tuner = kt.RandomSearch(build, objective="loss", max_trials=1, directory=str(tmp_path), project_name="p")
    trial = tuner.oracle.create_trial("slot-0")
    model = kt_compat.build_model(tuner, trial.hyperparameters)
    model.build((None, 3))
    checkpoint = Path(kt_compat.checkpoint_path(tuner, trial.trial_id))
    assert checkpoint.parent.name == f"trial_{trial.trial_id}"
    checkpoint.parent.mkdir(parents=True, exist_ok=True)
    model.save_weights(checkpoint)
    Path(kt_compat.build_config_path(tuner, trial.trial_id)).write_text(json.dumps(model.get_build_config()))
    loaded = tuner.load_model(trial)  # KerasTuner reads both files where compat says they are
    assert [w.shape for w in loaded.weights] == [w.shape for w in model.weights]


# -- Ray -------------------------------------------------------------------------------------------------------------
RAY_DRIVER = textwrap.dedent(
    """
    import json, sys, time
    import ray
    from aibro_core.compat import ray as ray_compat

    ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)

    @ray.remote(num_cpus=0)
    class Actor:
        def pid(self):
            import os
            return os.getpid()

    actor = Actor.remote()
    pid = ray.get(actor.pid.remote(), timeout=120)
    deadline = time.monotonic() + 60
    while not (entry := ray_compat.actor_table_entry(actor)).get("Pid") and time.monotonic() < deadline:
        time.sleep(0.2)
    nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
    print(json.dumps({"pid": pid, "entry": entry, "nodes": nodes,
                      "available": ray_compat.available_resources_per_node()}, default=str))
    """
)


@pytest.fixture(scope="module")
def ray_seen() -> dict[str, Any]:
    """The compat functions' answers from a driver of their own (tests never call ray.init in-process: see
    ray_cluster.py) against a one-node cluster."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ray_cluster import start_cluster

    with start_cluster({}) as cluster:
        done = subprocess.run(
            [sys.executable, "-c", RAY_DRIVER, cluster.address],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
        )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_state_actors_by_actor_handle_actor_id(ray_seen: dict[str, Any]) -> None:
    entry = ray_seen["entry"]
    assert entry["Pid"] == ray_seen["pid"] and entry["Address"]["NodeID"] in ray_seen["nodes"]


def test_state_available_resources_per_node(ray_seen: dict[str, Any]) -> None:
    available = ray_seen["available"]
    assert set(available) == set(ray_seen["nodes"]) and all(isinstance(v, dict) for v in available.values())
