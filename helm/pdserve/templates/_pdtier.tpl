{{/*
One PD tier (Deployment + headless Service); call with (dict "ctx" $ "role" "prefill").
The node binds and advertises the pod IP: the registry record's http_url is built from
--host:--port, so binding 0.0.0.0 would publish an unreachable address.
*/}}
{{- define "pdserve.pdTier" -}}
{{- $ := .ctx -}}
{{- $role := .role -}}
{{- $tier := index $.Values $role -}}
{{- $fullname := include "pdserve.fullname" $ -}}
{{- $rdma := $.Values.rdma.enabled -}}
{{- $hostNet := and $rdma $.Values.rdma.hostNetwork -}}
{{- $sc := deepCopy ($.Values.securityContext | default dict) -}}
{{- if $rdma -}}
{{- $caps := deepCopy (get $sc "capabilities" | default dict) -}}
{{- $add := get $caps "add" | default list -}}
{{- $_ := set $caps "add" (append $add "IPC_LOCK" | uniq) -}}
{{- $_ := set $sc "capabilities" $caps -}}
{{- end -}}
{{- $res := deepCopy ($tier.resources | default dict) -}}
{{- if $rdma -}}
{{- $req := deepCopy (get $res "requests" | default dict) -}}
{{- $lim := deepCopy (get $res "limits" | default dict) -}}
{{- $_ := set $req $.Values.rdma.resourceName ($.Values.rdma.resourceCount | toString) -}}
{{- $_ := set $lim $.Values.rdma.resourceName ($.Values.rdma.resourceCount | toString) -}}
{{- $_ := set $res "requests" $req -}}
{{- $_ := set $res "limits" $lim -}}
{{- end -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ $fullname }}-{{ $role }}
  labels:
    {{- include "pdserve.labels" (dict "ctx" $ "component" $role) | nindent 4 }}
spec:
  replicas: {{ $tier.replicas }}
  selector:
    matchLabels:
      {{- include "pdserve.selectorLabels" (dict "ctx" $ "component" $role) | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "pdserve.labels" (dict "ctx" $ "component" $role) | nindent 8 }}
      {{- with (include "pdserve.podAnnotations" (dict "ctx" $ "port" $tier.port "extra" $tier.podAnnotations) | trim) }}
      annotations:
        {{- . | nindent 8 }}
      {{- end }}
    spec:
      {{- with $.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- if $hostNet }}
      hostNetwork: true
      dnsPolicy: ClusterFirstWithHostNet
      {{- end }}
      {{- with $.Values.podSecurityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with (include "pdserve.modelInit" $ | trim) }}{{ . | nindent 6 }}{{- end }}
      containers:
        - name: {{ $role }}
          image: {{ include "pdserve.image" $ }}
          imagePullPolicy: {{ $.Values.image.pullPolicy }}
          command: ["pdserve"]
          args:
            - {{ $role }}
            - --model
            - {{ $.Values.model.name | quote }}
            {{- with $.Values.model.servedModelName }}
            - --served-model-name
            - {{ . | quote }}
            {{- end }}
            - --model-cache-dir
            - {{ $.Values.model.cacheDir | quote }}
            - --registry
            - {{ include "pdserve.registryUrl" $ | quote }}
            {{- if $.Values.registry.auth.enabled }}
            - --registry-token
            - $(PDSERVE_REGISTRY_TOKEN)
            {{- end }}
            - --registry-ttl-s
            - {{ $.Values.pd.registryTtlS | quote }}
            - --node-id
            - $(POD_NAME)
            - --host
            - $(POD_IP)
            - --port
            - {{ $tier.port | quote }}
            - --kv-host
            - $(POD_IP)
            - --transfer-backend
            - {{ $.Values.transfer.backend }}
            {{- if eq $.Values.transfer.backend "mooncake" }}
            - --mooncake-protocol
            - {{ ternary "rdma" $.Values.transfer.mooncakeProtocol $rdma }}
            {{- if $rdma }}
            - --mooncake-device
            - {{ $.Values.rdma.device | quote }}
            {{- end }}
            {{- end }}
            - --dtype
            - {{ $.Values.engine.dtype }}
            - --device
            - {{ $.Values.engine.device | quote }}
            - --page-size
            - {{ $.Values.engine.pageSize | quote }}
            - --max-running-requests
            - {{ $tier.maxRunningRequests | quote }}
            - --kv-cache-mb
            - {{ $tier.kvCacheMb | quote }}
            {{- if eq $role "prefill" }}
            - --chunked-prefill-size
            - {{ $tier.chunkedPrefillSize | quote }}
            {{- end }}
            - --log-level
            - {{ $.Values.engine.logLevel }}
            {{- range $tier.extraArgs }}
            - {{ . | quote }}
            {{- end }}
          env:
            {{- include "pdserve.commonEnv" $ | nindent 12 }}
            {{- with $tier.env }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          ports:
            - name: http
              containerPort: {{ $tier.port }}
              protocol: TCP
          {{- with (include "pdserve.probes" (dict "port" "http" "startup" $.Values.pd.startupProbe) | trim) }}{{ . | nindent 10 }}{{- end }}
          {{- with $res }}
          resources:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          {{- with $sc }}
          securityContext:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          {{- $mounts := include "pdserve.modelMounts" $ | trim }}
          {{- if $mounts }}
          volumeMounts:
            {{- $mounts | nindent 12 }}
          {{- end }}
      {{- $vols := include "pdserve.modelVolumes" $ | trim }}
      {{- if $vols }}
      volumes:
        {{- $vols | nindent 8 }}
      {{- end }}
      {{- with $tier.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $tier.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $tier.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
---
# Headless Service: stable DNS per pod and the target of the ServiceMonitor. Clients do not
# call the nodes through it; the router finds them in the registry.
apiVersion: v1
kind: Service
metadata:
  name: {{ $fullname }}-{{ $role }}
  labels:
    {{- include "pdserve.labels" (dict "ctx" $ "component" $role) | nindent 4 }}
spec:
  clusterIP: None
  selector:
    {{- include "pdserve.selectorLabels" (dict "ctx" $ "component" $role) | nindent 4 }}
  ports:
    - name: http
      port: {{ $tier.port }}
      targetPort: http
      protocol: TCP
{{- end -}}
