"""What the page shares across users, with no Gradio in it: the app (`server.App`), the per-tab session store
(`store`), the server-wide KV account (`accounting`), the folder of session files (`session_files`), the door every
job goes through (`door`, what its session jobs give: `runs`), the job records (`jobs`) and their two runners: in this
process (`runner`) and in a ZeroGPU worker (`device` on the server's side, `gpu_job`, `@spaces.GPU`, on the worker's,
with what the worker keeps warm: `warm_sessions`); the page's start per model (`recommended`) and the secret its kept
state is encrypted with (`secret`)."""
