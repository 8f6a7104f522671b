"""The engine that drives rounds beside the target (ADR 0014): one session type, the
schedule, the loop (schedule -> run -> postprocess) and the draft sources it reads."""
