"""The data stage: rows of any dataset a researcher brings, read without torch.

- sources.py: a path, a hub id in the cache or a `datasets` object, opened as {split: Dataset};
- columns.py: which columns hold prompt, answer, images, reference and system (layouts detected);
- images.py: image values decoded into the RGB images a model sees;
- paths.py: where the files rows name are read (inside the data folder, or media_root);
- fingerprint.py: what a resumed run compares to know its data did not change;
- order.py: the seeded order rows are served in, and the held-out rows.
The `dataset` task (tasks/dataset.py) puts them together into Examples.
"""
