"""The TensorFlow backend: imported the first time a TensorFlow tensor reaches a gradoverride
function (or by `gradoverride.keras`), never by `import gradoverride`."""
