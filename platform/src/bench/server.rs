//! `loraplex serve` as a child process, for load generators and black-box tests: started on a
//! free port, its address and first-start admin key read from what it prints, killed when
//! dropped.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};

use super::http::Client;

pub struct Server {
    pub child: Child,
    pub addr: String,
    /// The operator key it printed on its first start, if it did.
    pub admin: Option<String>,
    /// What it printed after its address, as it comes.
    pub output: Arc<Mutex<Vec<String>>>,
}

impl Server {
    /// Starts `exe serve --port 0 --data-dir DATA ARGS...` and waits for its address.
    pub fn start(exe: &Path, data: &Path, args: &[&str]) -> std::io::Result<Server> {
        Self::start_with_env(exe, data, args, &[])
    }

    /// [`Server::start`] with these environment variables set for the server.
    pub fn start_with_env(exe: &Path, data: &Path, args: &[&str], env: &[(&str, &str)]) -> std::io::Result<Server> {
        let child = Command::new(exe)
            .args(["serve", "--port", "0", "--data-dir"])
            .arg(data)
            .args(args)
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()?;
        // Owned by the guard at once, so the process is reaped on every path.
        let mut server = Server { child, addr: String::new(), admin: None, output: Arc::default() };
        let stdout = server.child.stdout.take().ok_or_else(|| std::io::Error::other("no stdout"))?;
        let mut lines = BufReader::new(stdout).lines();
        while let Some(line) = lines.next() {
            let line = line?;
            if let Some(key) = line.strip_prefix("admin key (shown once; keep it): ") {
                server.admin = Some(key.to_string());
            }
            if let Some(addr) = line.strip_prefix("listening on http://") {
                server.addr = addr.to_string();
                let output = server.output.clone();
                std::thread::spawn(move || lines.map_while(Result::ok).for_each(|l| output.lock().unwrap_or_else(|e| e.into_inner()).push(l)));
                return Ok(server);
            }
            server.output.lock().unwrap_or_else(|e| e.into_inner()).push(line);
        }
        let said = server.output.lock().unwrap_or_else(|e| e.into_inner()).join("\n");
        Err(std::io::Error::other(format!("the server exited before printing its address: {said}")))
    }

    /// The address of its keyless metrics port (`--metrics-port`), once it has printed it.
    pub fn metrics_addr(&self) -> Option<String> {
        let out = self.output.lock().unwrap_or_else(|e| e.into_inner());
        out.iter().find_map(|l| l.strip_prefix("metrics (no key) on http://").and_then(|a| a.strip_suffix("/metrics")).map(str::to_string))
    }

    pub fn client(&self) -> Client {
        Client::new(self.addr.clone())
    }

    /// Kills it at once (SIGKILL), as a crash would.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}
