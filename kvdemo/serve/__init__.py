"""What the page shares across users, with no Gradio in it: the app (`server.App`), the per-tab session store
(`store`) and the server-wide KV account (`accounting`)."""
