"""What the page shares across users, with no Gradio in it: the app (`server.App`), the per-tab session store
(`store`), the server-wide KV account (`accounting`), the folder of session files (`session_files`), and the
ZeroGPU job (`gpu_job`, `@spaces.GPU`) with what its worker keeps warm (`warm_sessions`)."""
