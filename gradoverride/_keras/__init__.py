"""`gradoverride.keras.Layer` on every Keras 3 backend: `_layer.py` (the class, and the op
its subclass's `call` becomes on TensorFlow), `_stateless.py` (the op on JAX and torch,
which takes the variables' values as an argument). Imports Keras, never TensorFlow itself.
"""
