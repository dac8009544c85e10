"""One recipe per keras-io example: where it is, which commit was read, and the few exact-string changes that make it
run here in seconds: data loading replaced by stand-ins of the same shapes and dtypes (standins.py), epochs and
sizes cut down, pretrained weights dropped. Everything else runs as printed. The originals are not in this
repository: they are read from a keras-io checkout given to the runner (--keras-io).

A substitution quotes only as much of the original as it needs to be found.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Recipe:
    name: str
    path: str  # in keras-io
    commit: str  # the version read
    category: str
    call: str  # the designated call: "NAME.fit(" / "NAME.search(" (the first cell holding it runs remotely)
    nth: int = 0  # or the nth (from 0) cell holding it
    subs: tuple[tuple[str, str], ...] = ()
    drop: tuple[str, ...] = ()  # cells holding any of these are left out (plots, inference on downloads)
    stop_after: str | None = None  # no cell after the one holding this
    kind: str = "fit"
    flags: str = ""
    setup: str = ""  # more set-up code (files the example reads, written from stand-ins)
    why: str = ""  # what the recipe changes beyond data and sizes, and why


MNIST = ("keras.datasets.mnist.load_data()", "standins.mnist()")

CALLBACK_SUBS = (
    ("tf.keras.datasets.mnist.load_data()", "standins.mnist(1000, 256)"),
    ("np.Inf", "np.inf"),
    ('hasattr(self.model.optimizer, "lr")', 'hasattr(self.model.optimizer, "learning_rate")'),
    (
        "float(tf.keras.backend.get_value(self.model.optimizer.learning_rate))",
        "float(self.model.optimizer.learning_rate)",
    ),
    (
        "tf.keras.backend.set_value(self.model.optimizer.lr, scheduled_lr)",
        "self.model.optimizer.learning_rate = scheduled_lr",
    ),
)
CALLBACK_WHY = (
    "Keras 3 and NumPy 2 cannot run three lines as printed: np.Inf is gone (np.inf), optimizers have no `lr` "
    "(learning_rate) and tf.keras.backend has no get_value/set_value (read and assign learning_rate)"
)
KT_SUBS = (
    ("keras.datasets.mnist.load_data()", "standins.mnist()"),
    ("x[:-10000]", "x[:-128]"),
    ("x[-10000:]", "x[-128:]"),
    ("y[:-10000]", "y[:-128]"),
    ("y[-10000:]", "y[-128:]"),
    ("best_model.build(input_shape=(None, 28, 28))\n", ""),
)
KT_DROP = (
    "def keras_code(",
    'project_name="keep_code_separate"',
    "from keras_tuner.applications import HyperResNet",
    'project_name="built_in_hypermodel"',
    "x_train[:100], y_train[:100], epochs=1",
)
KT_WHY = (
    "Keras 3 refuses to build the already-built best model again with another input shape, so that build() line "
    "is left out; so is the end of the guide: keras_code() saves to a path without .keras, which Keras 3 "
    "refuses, and the HyperResNet search is minutes on a CPU"
)

RECIPES: list[Recipe] = [
    Recipe(
        name="vae",
        path="examples/generative/vae.py",
        commit="cca4efba8e0b8514ae3817931696294039b3bfc9",
        category="generative",
        call="vae.fit(",
        subs=(
            ("tf.keras.backend.random_normal(", "tf.random.normal("),
            MNIST,
            ("epochs=30, batch_size=128", "epochs=2, batch_size=128"),
            ("plot_latent_space(vae)\n", "plot_latent_space(vae, n=3)\n"),
        ),
        why="tf.keras.backend.random_normal is gone in Keras 3 (the example as read predates it): tf.random.normal",
    ),
    Recipe(
        name="knowledge_distillation",
        path="examples/vision/knowledge_distillation.py",
        commit="501fb4cbe62e5b5c434393f512a452ef833640a1",
        category="vision",
        call="distiller.fit(",
        subs=(
            MNIST,
            ("teacher.fit(x_train, y_train, epochs=5)", "teacher.fit(x_train, y_train, epochs=1)"),
            ("distiller.fit(x_train, y_train, epochs=3)", "distiller.fit(x_train, y_train, epochs=2)"),
            ("student_scratch.fit(x_train, y_train, epochs=3)", "student_scratch.fit(x_train, y_train, epochs=1)"),
        ),
    ),
    Recipe(
        name="siamese_contrastive",
        path="examples/vision/siamese_contrastive.py",
        commit="12bad05fbf95911b2e994cde3c9340c13a5e76d0",
        category="vision",
        call="siamese.fit(",
        flags="--unsafe",
        subs=(
            MNIST,
            ("epochs = 10", "epochs = 2"),
            ("x_train_val[:30000], x_train_val[30000:]", "x_train_val[:384], x_train_val[384:]"),
            ("y_train_val[:30000], y_train_val[30000:]", "y_train_val[:384], y_train_val[384:]"),
        ),
        why="a Lambda layer: run with --unsafe, the fix the refusal names",
    ),
    Recipe(
        name="dcgan_overriding_train_step",
        path="examples/generative/dcgan_overriding_train_step.py",
        commit="cca4efba8e0b8514ae3817931696294039b3bfc9",
        category="generative",
        call="gan.fit(",
        subs=(
            ("import gdown\n", ""),
            ("gdown.download(url, output, quiet=True)", "standins.celeba_zip(output)"),
        ),
    ),
    Recipe(
        name="wgan_gp",
        path="examples/generative/wgan_gp.py",
        commit="81aa0edb72a1735c5c577f123bb3a4a475a181c9",
        category="generative",
        call="wgan.fit(",
        subs=(
            ("fashion_mnist.load_data()", "standins.fashion_mnist(256, 64)"),
            ("BATCH_SIZE = 512", "BATCH_SIZE = 64"),
            ("epochs = 20", "epochs = 2"),
            ("_19.png", "_1.png"),
        ),
    ),
    Recipe(
        name="customizing_fit_gan",
        path="guides/customizing_what_happens_in_fit.py",
        commit="ad4fc805f5e1a4a4c0bcdd416aa9feac6608fb6c",
        category="guide: fit/train_step",
        call="gan.fit(",
        subs=(
            MNIST,
            ("keras.losses.mean_squared_error(y, y_pred)", "keras.losses.MeanSquaredError()(y, y_pred)"),
        ),
        why="tf.keras.losses has no mean_squared_error function under Keras 3 (MeanSquaredError()); "
        "the guide's last fit, the GAN (two optimizers, no call()), is the remote one; the others run locally",
    ),
    Recipe(
        name="text_classification_from_scratch",
        path="examples/nlp/text_classification_from_scratch.py",
        commit="ef4cd453400aae442632ffdba260673ecc09500a",
        category="nlp",
        call="model.fit(train_ds",
        setup='standins.text_folders("aclImdb")',
        subs=(("epochs = 3", "epochs = 2"),),
    ),
    Recipe(
        name="callbacks_printing",
        path="guides/writing_your_own_callbacks.py",
        commit="040e8ba4b4bf32ba42d56130fd0f793bec57d097",
        category="guide: callbacks",
        call="model.fit(",
        nth=1,
        subs=CALLBACK_SUBS,
        why=CALLBACK_WHY + "; the remote fit is the one with LossAndErrorPrintingCallback (prints per batch, epoch)",
    ),
    Recipe(
        name="callbacks_early_stopping",
        path="guides/writing_your_own_callbacks.py",
        commit="040e8ba4b4bf32ba42d56130fd0f793bec57d097",
        category="guide: callbacks",
        call="model.fit(",
        nth=2,
        subs=CALLBACK_SUBS,
        why=CALLBACK_WHY + "; the remote fit is EarlyStoppingAtMinLoss's (stop_training, set_weights)",
    ),
    Recipe(
        name="callbacks_lr_scheduler",
        path="guides/writing_your_own_callbacks.py",
        commit="040e8ba4b4bf32ba42d56130fd0f793bec57d097",
        category="guide: callbacks",
        call="model.fit(",
        nth=3,
        subs=CALLBACK_SUBS,
        why=CALLBACK_WHY + "; the remote fit is CustomLearningRateScheduler's (a schedule function as argument)",
    ),
    Recipe(
        name="kt_getting_started",
        path="guides/keras_tuner/getting_started.py",
        commit="0be9a38b96e8dd85bc525a74babb614f38b179c7",
        category="guide: KerasTuner",
        call="tuner.search(x_train, y_train, epochs=2",
        kind="tune",
        subs=KT_SUBS,
        drop=KT_DROP,
        why="RandomSearch of build_model with executions_per_trial=2; " + KT_WHY,
    ),
    Recipe(
        name="kt_getting_started_hypermodel",
        path="guides/keras_tuner/getting_started.py",
        commit="0be9a38b96e8dd85bc525a74babb614f38b179c7",
        category="guide: KerasTuner",
        call="tuner.search(x_train, y_train, epochs=2",
        nth=1,
        kind="tune",
        subs=KT_SUBS,
        drop=KT_DROP,
        why="the search of MyHyperModel (a HyperModel subclass whose fit() crops and shuffles); " + KT_WHY,
    ),
    Recipe(
        name="kt_getting_started_objective",
        path="guides/keras_tuner/getting_started.py",
        commit="0be9a38b96e8dd85bc525a74babb614f38b179c7",
        category="guide: KerasTuner",
        call="tuner.search(",
        nth=3,
        kind="tune",
        subs=KT_SUBS,
        drop=KT_DROP,
        why="the search with keras_tuner.Objective('val_custom_metric', 'min') over a custom Metric; " + KT_WHY,
    ),
    Recipe(
        name="mnist_convnet",
        path="examples/vision/mnist_convnet.py",
        commit="02cfe8063b505adc073986c91729f22039f77ad0",
        category="vision",
        call="model.fit(",
        subs=(MNIST, ("epochs = 15", "epochs = 2")),
    ),
    Recipe(
        name="bidirectional_lstm_imdb",
        path="examples/nlp/bidirectional_lstm_imdb.py",
        commit="0a4be8bbc3ae126f3ca49a0bf173902866ec06f0",
        category="nlp",
        call="model.fit(",
        subs=(("keras.datasets.imdb.load_data(", "standins.imdb("),),
    ),
    Recipe(
        name="timeseries_classification_from_scratch",
        path="examples/timeseries/timeseries_classification_from_scratch.py",
        commit="ad4fc805f5e1a4a4c0bcdd416aa9feac6608fb6c",
        category="timeseries",
        call="history = model.fit(",
        subs=(
            (
                'root_url = "https://raw.githubusercontent.com/hfawaz/cd-diagram/master/FordA/"',
                'root_url = standins.forda("FordA") + "/"',
            ),
            ("keras.utils.plot_model(model, show_shapes=True)", "model.summary()"),
            ("epochs = 500", "epochs = 2"),
        ),
        why="plot_model needs pydot and graphviz, not installed here: model.summary() instead",
    ),
    Recipe(
        name="structured_data_feature_space",
        path="examples/structured_data/structured_data_classification_with_feature_space.py",
        commit="f54746f7633a6e4eedb38f273ab4c71944f01df6",
        category="structured_data",
        call="training_model.fit(",
        subs=(
            (
                'file_url = "http://storage.googleapis.com/download.tensorflow.org/data/heart.csv"',
                'file_url = standins.heart_csv("heart.csv")',
            ),
            ("epochs=20,", "epochs=2,"),
        ),
    ),
    Recipe(
        name="imbalanced_classification",
        path="examples/structured_data/imbalanced_classification.py",
        commit="d8288ba8f6cc707577aebf2321229a5f40419046",
        category="structured_data",
        call="model.fit(",
        subs=(
            ('fname = "/Users/fchollet/Downloads/creditcard.csv"', 'fname = standins.creditcard_csv("creditcard.csv")'),
            ("epochs=30,", "epochs=2,"),
        ),
    ),
    Recipe(
        name="timeseries_anomaly_detection",
        path="examples/timeseries/timeseries_anomaly_detection.py",
        commit="ad4fc805f5e1a4a4c0bcdd416aa9feac6608fb6c",
        category="timeseries",
        call="history = model.fit(",
        setup=(
            'standins.nab_csv("nab/artificialNoAnomaly/art_daily_small_noise.csv")\n'
            'standins.nab_csv("nab/artificialWithAnomaly/art_daily_jumpsup.csv", anomaly=True)'
        ),
        subs=(
            (
                'master_url_root = "https://raw.githubusercontent.com/numenta/NAB/master/data/"',
                'master_url_root = "nab/"',
            ),
            ("epochs=50,", "epochs=2,"),
        ),
    ),
    Recipe(
        name="autoencoder_denoising",
        path="examples/vision/autoencoder.py",
        commit="f8f7dd396e1af11bccdc6bb6869e4f9be0bf9e32",
        category="vision",
        call="autoencoder.fit(",
        subs=(("mnist.load_data()", "standins.mnist()"), ("epochs=50,", "epochs=2,"), ("epochs=100,", "epochs=1,")),
        why="the first fit is the remote one; the second (denoising) fit then continues locally on the trained model",
    ),
    Recipe(
        name="transfer_learning",
        path="guides/transfer_learning.py",
        commit="1bc3fb07ff3d214073384770b60ccbd0c0873f8d",
        category="guide: transfer learning",
        call="model.fit(train_ds, epochs=epochs",
        subs=(
            ("import tensorflow_datasets as tfds", "tfds = standins.FakeTfds()"),
            ('weights="imagenet",  # Load weights', "weights=None,  # Load weights"),
            ("epochs = 20", "epochs = 1"),
            ("epochs = 10", "epochs = 1"),
        ),
        why="tensorflow_datasets is not installed: a stand-in object answers tfds.load with cats_vs_dogs-shaped "
        "datasets; Xception with weights=None (no download); the frozen-base fit is the remote one, the "
        "fine-tuning fit then runs locally on the trained model",
    ),
    Recipe(
        name="subclassing_vae",
        path="guides/making_new_layers_and_models_via_subclassing.py",
        commit="175a5e441aee7e228bfa9100bab65c2dae303273",
        category="guide: subclassing",
        call="vae.fit(",
        subs=(
            ("keras.backend.random_normal(", "tf.random.normal("),
            MNIST,
            ("x_train.reshape(60000, 784)", "x_train.reshape(512, 784)"),
        ),
        why="keras.backend.random_normal is gone in Keras 3 (tf.random.normal); MNIST's 60000 in a reshape "
        "becomes the stand-in's 512",
    ),
    Recipe(
        name="addition_rnn",
        path="examples/nlp/addition_rnn.py",
        commit="653efec051cf5ad149f93795a218fdd7c27d1afb",
        category="nlp",
        call="model.fit(",
        subs=(
            ("TRAINING_SIZE = 50000", "TRAINING_SIZE = 2000"),
            ("dtype=np.bool)", "dtype=bool)"),
            ("epochs = 30", "epochs = 3"),
        ),
        why="np.bool is gone in NumPy 2 (bool); its fit runs inside a for loop over epochs, one fit per iteration",
    ),
    Recipe(
        name="text_classification_with_transformer",
        path="examples/nlp/text_classification_with_transformer.py",
        commit="8bda227c08adf855a8b9ec579840e2a7171fff60",
        category="nlp",
        call="history = model.fit(",
        subs=(
            ("keras.datasets.imdb.load_data(", "standins.imdb("),
            ("def call(self, inputs, training):", "def call(self, inputs, training=None):"),
        ),
        why="Keras 3 calls a layer in a functional graph without `training`, which the printed call() requires "
        "(TypeError: missing a required argument: 'training'): training=None",
    ),
    Recipe(
        name="collaborative_filtering_movielens",
        path="examples/structured_data/collaborative_filtering_movielens.py",
        commit="ff6a507b2737777a8845ff9a2f1caf7f53ce3e78",
        category="structured_data",
        call="history = model.fit(",
        subs=(
            (
                'keras.utils.get_file(\n    "ml-latest-small.zip", movielens_data_file_url, extract=False\n)',
                'standins.movielens_zip("ml-latest-small.zip")',
            ),
            ("epochs=5,", "epochs=2,"),
        ),
    ),
    Recipe(
        name="conditional_gan",
        path="examples/generative/conditional_gan.py",
        commit="8bda227c08adf855a8b9ec579840e2a7171fff60",
        category="generative",
        call="cond_gan.fit(",
        subs=(
            ("from tensorflow_docs.vis import embed\n", ""),
            ("import imageio\n", ""),
            MNIST,
            ("epochs=20)", "epochs=2)"),
            (
                "all_labels = keras.utils.to_categorical(all_labels, 10)",
                'all_labels = keras.utils.to_categorical(all_labels, 10).astype("float32")',
            ),
        ),
        drop=('imageio.mimsave("animation.gif"',),
        why="tensorflow_docs and imageio are not installed: their imports and the cell that writes the GIF are "
        "left out (the interpolation with the trained generator still runs); Keras 3's to_categorical gives "
        "float64, which train_step's tf.concat with float32 images refuses, so the labels are cast to float32",
    ),
    Recipe(
        name="timeseries_weather_forecasting",
        path="examples/timeseries/timeseries_weather_forecasting.py",
        commit="e70ae747b458a92dfd71486bf65f4eb2d265f7b0",
        category="timeseries",
        call="history = model.fit(",
        subs=(
            (
                'keras.utils.get_file(origin=uri, fname="jena_climate_2009_2016.csv.zip")',
                'standins.jena_zip("jena_climate_2009_2016.csv.zip")',
            ),
            ("epochs = 10", "epochs = 2"),
            ("plt.matshow(data.corr())", "plt.matshow(data.corr(numeric_only=True))"),
            ('path_checkpoint = "model_checkpoint.h5"', 'path_checkpoint = "model_checkpoint.weights.h5"'),
        ),
        why="Keras 3 ModelCheckpoint(save_weights_only=True) needs a name ending in .weights.h5; pandas 2 no "
        "longer skips the 'Date Time' strings in DataFrame.corr() (numeric_only=True); "
        "6000 rows of Jena-shaped weather (enough for 720-step windows in both splits)",
    ),
    Recipe(
        name="timeseries_classification_transformer",
        path="examples/timeseries/timeseries_classification_transformer.py",
        commit="dc8c9b4ab936f7111ef5b0c09fff761e9327eb33",
        category="timeseries",
        call="model.fit(",
        subs=(
            (
                'root_url = "https://raw.githubusercontent.com/hfawaz/cd-diagram/master/FordA/"',
                'root_url = standins.forda("FordA") + "/"',
            ),
            ("epochs=200,", "epochs=2,"),
        ),
    ),
    Recipe(
        name="lstm_character_level_text_generation",
        path="examples/generative/lstm_character_level_text_generation.py",
        commit="61b6dba5e62808524df142b4c56d8266add5d349",
        category="generative",
        call="model.fit(",
        subs=(
            (
                'keras.utils.get_file(\n    "nietzsche.txt", origin="https://s3.amazonaws.com/text-datasets/nietzsche.txt"\n)',
                'standins.text_file("nietzsche.txt")',
            ),
            ("dtype=np.bool)", "dtype=bool)"),
            ("epochs = 40", "epochs = 2"),
            ("for i in range(400):", "for i in range(20):"),
        ),
        why="np.bool is gone in NumPy 2 (bool); 20 generated characters per diversity instead of 400 (each one a "
        "predict call); its fit runs inside the epoch loop",
    ),
    Recipe(
        name="structured_data_from_scratch",
        path="examples/structured_data/structured_data_classification_from_scratch.py",
        commit="b0d68751937c4e87063b1267e6562a70481d879f",
        category="structured_data",
        call="model.fit(",
        subs=(
            (
                'file_url = "http://storage.googleapis.com/download.tensorflow.org/data/heart.csv"',
                'file_url = standins.heart_csv("heart.csv")',
            ),
            ('lookup_class(output_mode="binary")', 'lookup_class(output_mode="multi_hot")'),
            ('keras.utils.plot_model(model, show_shapes=True, rankdir="LR")', "model.summary()"),
            ("epochs=50,", "epochs=2,"),
        ),
        why='Keras 3 lookup layers have no output_mode "binary" (renamed "multi_hot"); plot_model needs pydot '
        "and graphviz (model.summary() instead)",
    ),
    Recipe(
        name="mixup",
        path="examples/vision/mixup.py",
        commit="be6d3665bad56d9e9ce5ad7ef083da75dd514afc",
        category="vision",
        call="model.fit(train_ds_mu",
        subs=(
            ("tf.keras.datasets.fashion_mnist.load_data()", "standins.fashion_mnist()"),
            ("val_samples = 2000", "val_samples = 128"),
            ("EPOCHS = 10", "EPOCHS = 2"),
            ('"initial_weights.h5"', '"initial.weights.h5"'),
        ),
        why="Keras 3 save_weights/load_weights need a name ending in .weights.h5; the mixup fit (a zipped, "
        "mapped tf.data pipeline drawing Beta samples) is the remote one, the plain fit then runs locally",
    ),
    Recipe(
        name="kt_custom_tuner",
        path="guides/keras_tuner/custom_tuner.py",
        commit="13d741d9634831015df7686556620880bf28daa7",
        category="guide: KerasTuner",
        call="tuner.search(",
        kind="tune",
        subs=((".reset_states()", ".reset_state()"), ("callback.model = model", "callback.set_model(model)")),
        why="Keras 3 metrics have reset_state() (reset_states() is gone) and a callback's model is set with "
        "set_model() (its `model` property has no setter: every trial fails as printed, locally too); a HyperModel "
        "whose fit() is a custom training loop reading the notebook's x_train",
    ),
    Recipe(
        name="metric_learning",
        path="examples/vision/metric_learning.py",
        commit="653efec051cf5ad149f93795a218fdd7c27d1afb",
        category="vision",
        call="history = model.fit(",
        subs=(
            ("cifar10.load_data()", "standins.cifar10()"),
            ("np.random.randint(0, 50000, size=(5, 5))", "np.random.randint(0, 256, size=(5, 5))"),
            ("tf.nn.l2_normalize(embeddings, axis=-1)", "keras.ops.normalize(embeddings, axis=-1)"),
            ("AnchorPositivePairs(num_batchs=1000), epochs=20", "AnchorPositivePairs(num_batchs=20), epochs=2"),
        ),
        why="a TensorFlow op on a Keras 3 symbolic tensor is an error (tf.nn.l2_normalize -> keras.ops.normalize); "
        "the fit's data is a keras.utils.Sequence (PyDataset) drawing random pairs",
    ),
    Recipe(
        name="image_classification_from_scratch",
        path="examples/vision/image_classification_from_scratch.py",
        commit="b8bb4c0d5068d64290003740c2ef9e703eefa751",
        category="vision",
        call="model.fit(",
        setup='standins.image_folders("PetImages", ("Cat", "Dog"), per_class=20, size=64)',
        subs=(
            ("keras.utils.plot_model(model, show_shapes=True)", "model.summary()"),
            ("epochs = 50", "epochs = 1"),
            ('"PetImages/Cat/6779.jpg"', '"PetImages/Cat/1.jpg"'),
        ),
        why="JPEG folders written with PIL (they carry JFIF, so the corruption filter keeps them); plot_model needs "
        "pydot and graphviz (model.summary() instead); the inference cell reads one of the stand-in files",
    ),
    Recipe(
        name="lstm_seq2seq",
        path="examples/nlp/lstm_seq2seq.py",
        commit="7d9a8190d134b15aa8fb54b457e8ba6c1cb562a3",
        category="nlp",
        call="model.fit(",
        setup='standins.fra_txt("fra.txt")',
        subs=(
            ("epochs = 100", "epochs = 2"),
            ('model.save("s2s")', 'model.save("s2s.keras")'),
            ('keras.models.load_model("s2s")', 'keras.models.load_model("s2s.keras")'),
            ("for seq_index in range(20):", "for seq_index in range(2):"),
        ),
        why="Keras 3 saves only to .keras (the SavedModel folder 's2s' is refused); two decoded sentences instead "
        "of twenty (each character is a predict call)",
    ),
    Recipe(
        name="text_generation_with_miniature_gpt",
        path="examples/generative/text_generation_with_miniature_gpt.py",
        commit="b8bb4c0d5068d64290003740c2ef9e703eefa751",
        category="generative",
        call="model.fit(",
        setup='standins.text_folders("aclImdb", vocabulary=20000)',
        subs=(("epochs=25,", "epochs=2,"),),
        why="one stand-in review holds 20000 distinct words, so the vocabulary is as full as on IMDB (the text "
        "generator callback looks up any of the 20000 output indices in it)",
    ),
    Recipe(
        name="rnn_mnist_lstm",
        path="guides/working_with_rnns.py",
        commit="4849412cb6cd6089949fb97edf1758083c964416",
        category="guide: RNNs",
        call="model.fit(\n    x_train, y_train",
        subs=(
            ("mnist.load_data()", "standins.mnist()"),
            ("num_batches = 10", "num_batches = 1"),
            ("timestep = 50", "timestep = 5"),
        ),
        why="the remote fit is the first MNIST LSTM; the RNN(LSTMCell) model then copies its trained weights "
        "(set_weights) and trains locally, and a CPU copy predicts",
    ),
    Recipe(
        name="preprocessing_resnet50_augment",
        path="guides/preprocessing_layers.py",
        commit="04bfdf8adc4ea39646c3d09f3cd397f32f1a0923",
        category="guide: preprocessing layers",
        call="model.fit(train_dataset, steps_per_epoch=5)",
        subs=(
            ("keras.datasets.cifar10.load_data()", "standins.cifar10()"),
            ('output_mode="tf-idf"', 'output_mode="tf_idf"'),
        ),
        why="keras.applications.ResNet50(weights=None) inside a functional model, trained on a tf.data pipeline "
        "that maps random augmentation layers, with steps_per_epoch; Keras 3 spells the TextVectorization mode "
        "tf_idf",
    ),
    Recipe(
        name="preprocessing_text_gru",
        path="guides/preprocessing_layers.py",
        commit="04bfdf8adc4ea39646c3d09f3cd397f32f1a0923",
        category="guide: preprocessing layers",
        call="model.fit(train_dataset)",
        subs=(
            ("keras.datasets.cifar10.load_data()", "standins.cifar10()"),
            ('output_mode="tf-idf"', 'output_mode="tf_idf"'),
        ),
        why="a GRU on a dataset of strings mapped through an adapted TextVectorization; the trained model is then "
        "wrapped in an end-to-end model taking strings",
    ),
    Recipe(
        name="involution",
        path="examples/vision/involution.py",
        commit="b8bb4c0d5068d64290003740c2ef9e703eefa751",
        category="vision",
        call="inv_hist = inv_model.fit(",
        subs=(
            ("keras.datasets.cifar10.load_data()", "standins.cifar10()"),
            ("epochs=20, validation_data=test_ds)", "epochs=1, validation_data=test_ds)"),
        ),
        why="the remote fit is the involution model (a custom layer whose build() makes sublayers and keeps "
        "tf.identity as an attribute, returning two outputs); the conv model's fit before it runs locally",
    ),
    Recipe(
        name="speaker_recognition",
        path="examples/audio/speaker_recognition_using_cnn.py",
        commit="8bda227c08adf855a8b9ec579840e2a7171fff60",
        category="audio",
        call="history = model.fit(",
        subs=(
            (
                'DATASET_ROOT = os.path.join(os.path.expanduser("~"), "Downloads/16000_pcm_speeches")',
                'DATASET_ROOT = standins.speech_folders("16000_pcm_speeches")',
            ),
            ("BATCH_SIZE = 128", "BATCH_SIZE = 8"),
            ("EPOCHS = 100", "EPOCHS = 2"),
        ),
        why="WAV folders written with scipy (1 s at 16 kHz, already at the rate the example wants, so its ffmpeg "
        "resampling step finds nothing to do); batches of 8 so the demonstration's random picks stay in the batch",
    ),
    Recipe(
        name="pixelcnn",
        path="examples/generative/pixelcnn.py",
        commit="dad05faaae0b553f81d35175201035971725356d",
        category="generative",
        call="pixel_cnn.fit(",
        subs=(
            ("from tqdm import tqdm", "tqdm = iter  # tqdm is not installed here: no progress bar"),
            ("keras.datasets.mnist.load_data()", "standins.mnist(192, 64)"),
            ("epochs=50,", "epochs=1,"),
            ("for row in tqdm(range(rows)):", "for row in tqdm(range(2)):"),
            ("self.conv.kernel.get_shape()", "self.conv.kernel.shape"),
        ),
        why="Keras 3 variables have no get_shape() (.shape); tqdm is not installed (a plain iterator instead of its "
        "progress bar); two generated rows instead of "
        "28 (each pixel is a predict call); custom layers that keep a NumPy mask and assign to a kernel in call()",
    ),
    Recipe(
        name="pretrained_word_embeddings",
        path="examples/nlp/pretrained_word_embeddings.py",
        commit="ef4cd453400aae442632ffdba260673ecc09500a",
        category="nlp",
        call="model.fit(",
        subs=(
            ("data_path = keras.utils.get_file(", 'data_path = standins.news20("datasets/news20.tar.gz",'),
            (
                'os.path.join(\n    os.path.expanduser("~"), ".keras/datasets/glove.6B.100d.txt"\n)',
                'standins.glove("glove.6B.100d.txt")',
            ),
            ("epochs=20,", "epochs=2,"),
        ),
        why="a frozen Embedding initialized from GloVe-shaped vectors (keras.initializers.Constant of a NumPy "
        "matrix) under a Conv1D classifier; the trained model is then wrapped with the TextVectorization",
    ),
    Recipe(
        name="multi_label_classification",
        path="examples/nlp/multi_label_classification.py",
        commit="be6d3665bad56d9e9ce5ad7ef083da75dd514afc",
        category="nlp",
        call="history = shallow_mlp_model.fit(",
        subs=(
            (
                '"https://github.com/soumik12345/multi-label-text-classification/releases/download/v0.2/arxiv_data.csv"',
                'standins.arxiv_csv("arxiv_data.csv")',
            ),
            ("epochs = 20", "epochs = 2"),
            ("test_df.sample(100)", "test_df.sample(10)"),
        ),
        why="the stand-in test split holds 20 rows, so the inference demo samples 10 instead of 100",
    ),
    Recipe(
        name="functional_api_multi_io",
        path="guides/functional_api.py",
        commit="6f78709a673691753bdba7f1422390a73a93a1a5",
        category="guide: functional API",
        call='model.fit(\n    {"title": title_data',
        subs=(
            ("keras.utils.plot_model(", "standins.plot_model("),
            MNIST,
            ("x_train.reshape(60000, 784)", "x_train.reshape(512, 784)"),
            ("x_test.reshape(10000, 784)", "x_test.reshape(128, 784)"),
            ('"path_to_my_model"', '"path_to_my_model.keras"'),
            ("keras.datasets.cifar10.load_data()", "standins.cifar10()"),
            ("size=(1280, ", "size=(256, "),
            ("tf.keras.applications.VGG19()", "tf.keras.applications.VGG19(weights=None)"),
        ),
        why="the remote fit is the three-input, two-output ticket model trained on dicts of arrays with per-output "
        "losses and loss weights; plot_model needs pydot and graphviz (a no-op instead); Keras 3 saves only to "
        ".keras; VGG19 with weights=None (no download); 256 dummy tickets instead of 1280",
    ),
]
