"""ipywidgets panels: the machine picker, the live job progress panel and the timeline chart."""
