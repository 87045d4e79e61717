"""The mechanisms behind Snapshotter: state, layout, fences, staging, restore, timeline."""
