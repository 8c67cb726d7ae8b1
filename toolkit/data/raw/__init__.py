"""Raw shards, img2dataset's webdataset output: the folder layout and naming (``layout``), failure
reasons (``reasons``) and a reader that survives damaged tars (``reader``)."""
