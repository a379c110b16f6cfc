"""The model running: hobbitpy.Llama, the default configuration, chat templates, grammars, the server."""
