"""Every use of another library's private names, one module per library, each behind a small named function.

A release of tornado, Keras, KerasTuner, Ray or TensorFlow may change or drop any of them without notice: each
function's docstring says which internal it relies on, why no public API does the job, and which versions were
checked; tests/test_compat.py has one test per internal, named after it, and tests/try_newest.py runs them against
the newest releases. Import the library's module of this package (`from aibro_core.compat import keras as
keras_compat`): nothing here is imported before it is called."""
